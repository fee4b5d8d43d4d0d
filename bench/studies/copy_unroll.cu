// Session 20: does the KERNEL copy reach more of the raw copy with more bytes in flight per
// thread? The daemon's copy (copy_group_kernel in cuda/copy_ranges.cu: a grid-stride over the
// runs laid end to end in power-of-two slots, blockIdx.y picking the region, 512 threads, 8
// independent 16-byte loads per thread before its stores, streaming loads and stores) runs at
// the daemon's default cap of 64 CTAs, i.e. one CTA on half the SMs of an H200. This study times
// the same loop body with other (threads, unroll) pairs and load/store flavours, at caps 64,
// 132 and all resident CTAs, on the shape of issue 13's target: 1 GiB of a llama-3-8b-shaped
// per-layer cache (32 regions of 4,096 blocks of 64 KiB), random blocks (512 runs of 64 KiB per
// region) and contiguous ones (32 pieces of 1 MiB per region), device memory to device memory
// in one process (the daemon reads the owner's pool mapped over CUDA IPC: the same memory).
// GPU time by CUDA events, median of 15 launches after 3 warm-ups; the raw copy of 1 GiB
// (cudaMemcpyAsync) beside it. Every variant's bytes are checked once against the source.
//
//   nvcc -O3 -arch=sm_90 -o /tmp/copy_unroll bench/studies/copy_unroll.cu && /tmp/copy_unroll
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CHECK(x)                                                                 \
  do {                                                                           \
    cudaError_t e_ = (x);                                                        \
    if (e_ != cudaSuccess) {                                                     \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)

constexpr int64_t kRegions = 32, kBlocks = 4096, kBlockBytes = 64 << 10, kPull = 512;

enum Flavour { kStreaming = 0, kPlain = 1, kGlobalLoadNc = 2 };

template <int F>
__device__ __forceinline__ uint4 load(const uint4* p) {
  if constexpr (F == kStreaming) return __ldcs(p);
  else if constexpr (F == kGlobalLoadNc) return __ldg(p);
  else return *p;
}
template <int F>
__device__ __forceinline__ void store(uint4* p, uint4 v) {
  if constexpr (F == kStreaming) __stcs(p, v);
  else *p = v;
}

// runs: [dst_off, src_off, nbytes] per run; bases: [dst_base, src_base] per region.
template <int T, int U, int F>
__global__ void __launch_bounds__(T) copy_group(const int64_t* __restrict__ runs,
                                                const int64_t* __restrict__ bases,
                                                int64_t n_regions, int64_t total, int shift) {
  const int64_t mask = (int64_t{1} << shift) - 1;
  constexpr int64_t kTile = int64_t{T} * U;
  const int64_t step = int64_t{gridDim.x} * kTile;
  for (int64_t r = blockIdx.y; r < n_regions; r += gridDim.y) {
    const int64_t db = __ldg(bases + 2 * r), sb = __ldg(bases + 2 * r + 1);
    for (int64_t t0 = int64_t{blockIdx.x} * kTile; t0 < total; t0 += step) {
      uint4 tmp[U];
      uint4* dst[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t v = t0 + u * T + threadIdx.x;
        dst[u] = nullptr;
        if (v < total) {
          const int64_t* row = runs + 3 * (v >> shift);
          const int64_t off = v & mask;
          if (off < __ldg(row + 2) / 16) {
            dst[u] = reinterpret_cast<uint4*>(db + __ldg(row)) + off;
            tmp[u] = load<F>(reinterpret_cast<const uint4*>(sb + __ldg(row + 1)) + off);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (dst[u] != nullptr) store<F>(dst[u], tmp[u]);
      }
    }
  }
}

struct Table {
  std::vector<int64_t> host;  // runs then bases
  int64_t n_runs, longest;
};

Table make_table(bool random, char* dst, char* src, std::mt19937_64& rng) {
  Table t;
  std::vector<int64_t> ids(kBlocks);
  for (int64_t i = 0; i < kBlocks; ++i) ids[i] = i;
  if (random) {
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<int64_t> dids(ids.begin() + kPull, ids.begin() + 2 * kPull);
    for (int64_t i = 0; i < kPull; ++i) {
      t.host.push_back(dids[i] * kBlockBytes);
      t.host.push_back(ids[i] * kBlockBytes);
      t.host.push_back(kBlockBytes);
    }
    t.n_runs = kPull;
    t.longest = kBlockBytes;
  } else {
    const int64_t piece = 1 << 20, n = kPull * kBlockBytes / piece;
    for (int64_t i = 0; i < n; ++i) {
      t.host.push_back(1024 * kBlockBytes + i * piece);
      t.host.push_back(i * piece);
      t.host.push_back(piece);
    }
    t.n_runs = n;
    t.longest = piece;
  }
  const int64_t region = kBlocks * kBlockBytes;
  for (int64_t r = 0; r < kRegions; ++r) {
    t.host.push_back(reinterpret_cast<int64_t>(dst) + r * region);
    t.host.push_back(reinterpret_cast<int64_t>(src) + r * region);
  }
  return t;
}

template <typename K>
int resident(K kernel, int threads) {
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  return std::max(per_sm, 1);
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Ctx {
  char *src, *dst;
  int64_t* d_table;
  int sms;
  cudaStream_t s;
  cudaEvent_t a, b;
};

// Times one variant at one cap on one table; returns GB/s (1 GiB / median GPU time), or -1 when
// its bytes differ from the source's.
template <int T, int U, int F>
double run(const Ctx& c, const Table& t, int64_t cap, int* grid_out) {
  auto kernel = copy_group<T, U, F>;
  int shift = 0;
  while ((int64_t{1} << shift) < t.longest / 16) ++shift;
  const int64_t total = t.n_runs << shift;
  const int64_t tiles = (total + int64_t{T} * U - 1) / (int64_t{T} * U);
  const int64_t cc = cap > 0 ? cap : int64_t{c.sms} * resident(kernel, T);
  const int64_t rows = std::min<int64_t>(kRegions, cc);
  const int64_t per_row = std::max<int64_t>(1, cc / rows);
  const dim3 grid(static_cast<unsigned>(std::min(tiles, per_row)), static_cast<unsigned>(rows));
  *grid_out = static_cast<int>(grid.x * grid.y);
  const int64_t* runs = c.d_table;
  const int64_t* bases = c.d_table + 3 * t.n_runs;
  CHECK(cudaMemsetAsync(c.dst, 0, kRegions * kBlocks * kBlockBytes, c.s));
  std::vector<float> ms;
  for (int i = 0; i < 18; ++i) {
    CHECK(cudaEventRecord(c.a, c.s));
    kernel<<<grid, T, 0, c.s>>>(runs, bases, kRegions, total, shift);
    CHECK(cudaEventRecord(c.b, c.s));
    CHECK(cudaEventSynchronize(c.b));
    float m = 0;
    CHECK(cudaEventElapsedTime(&m, c.a, c.b));
    if (i >= 3) ms.push_back(m);
  }
  CHECK(cudaGetLastError());
  // Check the first and last run of the first and last region, 4 KiB of each.
  for (int64_t r : {int64_t{0}, kRegions - 1}) {
    for (int64_t k : {int64_t{0}, t.n_runs - 1}) {
      const int64_t* row = t.host.data() + 3 * k;
      const int64_t* base = t.host.data() + 3 * t.n_runs + 2 * r;
      std::vector<char> x(4096), y(4096);
      CHECK(cudaMemcpy(x.data(), reinterpret_cast<char*>(base[0] + row[0]) + row[2] - 4096, 4096,
                       cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(y.data(), reinterpret_cast<char*>(base[1] + row[1]) + row[2] - 4096, 4096,
                       cudaMemcpyDeviceToHost));
      if (x != y) return -1;
    }
  }
  return double(kPull) * kBlockBytes * kRegions / (median(ms) * 1e-3) / 1e9;
}

template <int T, int U, int F>
void row(const Ctx& c, const Table& t, const char* name, double raw) {
  std::printf("%-28s", name);
  for (int64_t cap : {64, 132, 0}) {
    int grid = 0;
    const double g = run<T, U, F>(c, t, cap, &grid);
    std::printf("  %7.0f (%.2f, %4d CTAs)", g, g / raw, grid);
  }
  std::printf("\n");
}

int main() {
  Ctx c{};
  CHECK(cudaSetDevice(0));
  CHECK(cudaDeviceGetAttribute(&c.sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t pool = size_t(kRegions) * kBlocks * kBlockBytes;
  CHECK(cudaMalloc(&c.src, pool));
  CHECK(cudaMalloc(&c.dst, pool));
  CHECK(cudaMemset(c.src, 7, pool));
  {  // distinct bytes per 4 KiB so a misplaced copy shows
    std::vector<uint32_t> pat(pool / 4 / 1024);
    for (size_t i = 0; i < pat.size(); ++i) pat[i] = uint32_t(i * 2654435761u);
    CHECK(cudaMemcpy2D(c.src, 4096, pat.data(), 4, 4, pat.size(), cudaMemcpyHostToDevice));
  }
  CHECK(cudaStreamCreateWithFlags(&c.s, cudaStreamNonBlocking));
  CHECK(cudaEventCreate(&c.a));
  CHECK(cudaEventCreate(&c.b));
  CHECK(cudaMalloc(&c.d_table, 8 << 20));
  const int64_t gib = kPull * kBlockBytes * kRegions;
  std::vector<float> ms;
  for (int i = 0; i < 18; ++i) {
    CHECK(cudaEventRecord(c.a, c.s));
    CHECK(cudaMemcpyAsync(c.dst, c.src, gib, cudaMemcpyDeviceToDevice, c.s));
    CHECK(cudaEventRecord(c.b, c.s));
    CHECK(cudaEventSynchronize(c.b));
    float m = 0;
    CHECK(cudaEventElapsedTime(&m, c.a, c.b));
    if (i >= 3) ms.push_back(m);
  }
  const double raw = gib / (median(ms) * 1e-3) / 1e9;
  std::printf("%d SMs; raw cudaMemcpyAsync of 1 GiB: %.0f GB/s (%.3f ms)\n", c.sms, raw,
              median(ms));
  std::mt19937_64 rng(1);
  for (bool random : {true, false}) {
    const Table t = make_table(random, c.dst, c.src, rng);
    CHECK(cudaMemcpy(c.d_table, t.host.data(), t.host.size() * 8, cudaMemcpyHostToDevice));
    std::printf("\n%s: GB/s (x raw, grid) at caps 64 | 132 | all resident\n",
                random ? "random 64 KiB blocks" : "contiguous, 1 MiB pieces");
    row<512, 8, kStreaming>(c, t, "512 x 8 .cs (the daemon's)", raw);
    row<512, 4, kStreaming>(c, t, "512 x 4 .cs", raw);
    row<512, 16, kStreaming>(c, t, "512 x 16 .cs", raw);
    row<256, 16, kStreaming>(c, t, "256 x 16 .cs", raw);
    row<1024, 8, kStreaming>(c, t, "1024 x 8 .cs", raw);
    row<256, 32, kStreaming>(c, t, "256 x 32 .cs", raw);
    row<512, 8, kPlain>(c, t, "512 x 8 plain", raw);
    row<512, 16, kPlain>(c, t, "512 x 16 plain", raw);
    row<512, 16, kGlobalLoadNc>(c, t, "512 x 16 ldg, plain store", raw);
  }
  return 0;
}
