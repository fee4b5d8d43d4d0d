// KERNEL pulls: copy a pull's byte ranges (its (region, block run) pieces) with SM loads and
// stores, in one launch, from memory another process exported over CUDA IPC into our pool.
//
// Op (namespace `kvxferd`, a fragment of the library that staging.cu defines; built into the
// same extension by kvxferd.kernels.loader):
//   kvxferd::copy_ranges(Tensor table, Tensor like, int max_ctas, int variant, int stream=0) -> str
//   kvxferd::copy_group(Tensor table, int n_runs, int n_regions, Tensor like, int max_ctas,
//                       int stream=0) -> str
// and copy_group again as the Python binding copy_group_raw (cuda/bindings.cpp), which the
// daemon's KERNEL pulls launch with: the table by its host address, the device by its index.
// table: CPU int64 tensor (n, 3), contiguous: one row [dst_addr, src_addr, nbytes] per piece;
// like: any CUDA tensor on the device that runs the copy; stream: the cudaStream_t to queue the
// work on, as an integer (torch.cuda.Stream.cuda_stream), or 0 for that device's current stream
// (a caller that passes its stream needs no stream or device context around the call);
// max_ctas: cap on the grid (0: as many CTAs as are resident on the device at once); variant:
// which kernel (kStride or kCtaPerPiece below). Every address must be usable on that device:
// its own memory, or memory mapped into its context (cuIpcOpenMemHandle). This op cannot know
// the mapped sizes: the caller (kvxferd.kernels.cuda_ops.copy_ranges) checks every piece against
// its region before calling.
//
// Vector width V: the largest of 16, 8, 4, 2, 1 bytes dividing every address and length (one
// OR over the table's rows, no gcd per row).
//
// kStride (the default): the raw copy's access pattern. The pieces are laid end to end in a
// virtual array of n * 2^shift vectors (2^shift: the longest piece in vectors, rounded up to a
// power of two; the host cuts runs into pieces of one power-of-two size, so most pieces fill
// their slot). A persistent grid of kStrideThreads-thread CTAs strides over it: consecutive
// threads take consecutive vectors (across piece boundaries), each finds its piece with a shift
// (piece = v >> shift, offset = v & mask) and its row in the table (read-only cache, shared by
// the whole warp); vectors past a short piece's end are skipped. Every thread issues
// kIpcUnroll independent loads before its first store; loads and stores are streaming (.cs).
//
// copy_group: the same copy for pieces that repeat over regions, as a pull of a per-layer cache
// is (every layer reads the same block runs): the table is the runs once ([dst_off, src_off,
// nbytes] per piece, offsets in bytes from a region's base) followed by one [dst_base,
// src_base] per region, so the host builds and uploads n_runs + n_regions rows instead of
// n_runs * n_regions. Kernel copy_group_kernel: the stride kernel over the runs, blockIdx.y
// picks the region (each CTA reads its two bases once per region); the grid never exceeds the
// cap: min(regions, cap) rows of cap / rows CTAs, rows striding over the regions. The caller
// (kvxferd.kernels.cuda_ops.copy_groups) checks every run against every region of the group
// before calling. A table of at most kInlineValues values (a 16-block pull of a 32-layer
// cache: 112), or of kLargeInlineValues where the CUDA version and the GPU allow 32 KB of launch
// parameters (1 GiB of random blocks: ~1,600), is passed by value as the kernel's parameter
// (copy_group_inline_kernel), so the launch needs no pinned copy, no device allocation and no
// upload: those took ~0.1 ms of a small pull's ~0.13 ms op call on an H200
// (bench/ipc_kernel.py, "launch parts").
//
// kCtaPerPiece (the first kernel, kept for the benchmark's comparison): CTA b copies pieces
// b, b + grid, ... each by all its kThreads threads in tiles.
//
// Measured side by side (docs/benchmarks.md, "Issue 13, second pass"; one H100, 1 GiB read over
// CUDA IPC): both kernels 0.54-0.65 of the raw copy on random 64 KiB blocks and 0.73-0.86 on
// contiguous runs, the same within the run-to-run spread. The 0.27 / 0.47 measured before was
// mostly host work inside the call (three gcd per row where one OR now is, and per-call
// checks of the region tensors).
//
// Errors: "" on success or a message, as in staging.cu (and for the same reason: no
// TORCH_CHECK with numbers; see the comment there).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "staging.cuh"

namespace kvxferd {

constexpr int kIpcUnroll = 8;
constexpr int kStrideThreads = 512;
constexpr int64_t kStride = 0;
constexpr int64_t kCtaPerPiece = 1;

// Table loads: through the read-only cache from global memory, or plain loads from a table
// passed by value as the kernel's parameter (__grid_constant__: read in place, never copied).
template <bool kGlobal>
__device__ __forceinline__ int64_t table_at(const int64_t* p) {
  if constexpr (kGlobal) {
    return __ldg(p);
  } else {
    return *p;
  }
}

// The grid-stride copy of one array of runs, [dst, src, nbytes] per run, its addresses relative
// to dst_base and src_base (both 0 when the rows hold absolute addresses): the body of every
// stride kernel below.
template <int V, bool kGlobal>
__device__ __forceinline__ void copy_runs(const int64_t* __restrict__ runs, int64_t dst_base,
                                          int64_t src_base, int64_t total, int shift) {
  using Vec = typename VecOf<V>::T;
  const int64_t mask = (int64_t{1} << shift) - 1;
  constexpr int64_t kTile = int64_t{kStrideThreads} * kIpcUnroll;
  const int64_t step = int64_t{gridDim.x} * kTile;
  for (int64_t t0 = int64_t{blockIdx.x} * kTile; t0 < total; t0 += step) {
    Vec tmp[kIpcUnroll];
    Vec* dst[kIpcUnroll];
#pragma unroll
    for (int u = 0; u < kIpcUnroll; ++u) {
      const int64_t v = t0 + u * kStrideThreads + threadIdx.x;
      dst[u] = nullptr;
      if (v < total) {
        const int64_t* row = runs + 3 * (v >> shift);
        const int64_t off = v & mask;
        if (off < table_at<kGlobal>(row + 2) / V) {
          dst[u] = reinterpret_cast<Vec*>(dst_base + table_at<kGlobal>(row)) + off;
          tmp[u] = __ldcs(reinterpret_cast<const Vec*>(src_base + table_at<kGlobal>(row + 1)) +
                          off);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kIpcUnroll; ++u) {
      if (dst[u] != nullptr) __stcs(dst[u], tmp[u]);
    }
  }
}

template <int V>
__global__ void __launch_bounds__(kStrideThreads)
    copy_stride_kernel(const int64_t* __restrict__ table, int64_t total, int shift) {
  copy_runs<V, true>(table, 0, 0, total, shift);
}

template <int V, bool kGlobal>
__device__ __forceinline__ void copy_group_body(const int64_t* __restrict__ runs,
                                                const int64_t* __restrict__ bases,
                                                int64_t n_regions, int64_t total, int shift) {
  // Regions blockIdx.y, blockIdx.y + gridDim.y, ...: a capped grid has fewer rows than regions.
  for (int64_t r = blockIdx.y; r < n_regions; r += gridDim.y) {
    copy_runs<V, kGlobal>(runs, table_at<kGlobal>(bases + 2 * r),
                          table_at<kGlobal>(bases + 2 * r + 1), total, shift);
  }
}

template <int V>
__global__ void __launch_bounds__(kStrideThreads)
    copy_group_kernel(const int64_t* __restrict__ runs, const int64_t* __restrict__ bases,
                      int64_t n_regions, int64_t total, int shift) {
  copy_group_body<V, true>(runs, bases, n_regions, total, shift);
}

// A table small enough to travel as the launch's parameter (the runs, then the bases): no
// pinned copy, no upload, no allocation per launch. 480 values keep every parameter of the
// launch within the 4 KiB any CUDA version accepts; from CUDA 12.1, on a driver of 12.1 or
// later and a GPU of compute capability 7.0 or more, a launch's parameters may take 32,764
// bytes, so kLargeInlineValues (32,000 bytes: 1 GiB of random 64 KiB blocks of a 32-layer cache
// is ~1,600 values) travel the same way instead of by a pinned upload and a device allocation
// (a 512-block pull's launch took 0.14 ms of the decode daemon's thread on an H200 that way:
// docs/benchmarks.md, "Session 23").
constexpr int64_t kInlineValues = 480;
struct InlineTable {
  int64_t v[kInlineValues];
};
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
#define KVXFERD_LARGE_PARAMS 1
constexpr int64_t kLargeInlineValues = 4000;
struct LargeInlineTable {
  int64_t v[kLargeInlineValues];
};
#else
constexpr int64_t kLargeInlineValues = 0;
#endif

template <int V, typename Table>
__global__ void __launch_bounds__(kStrideThreads)
    copy_group_inline_kernel(const __grid_constant__ Table table, int64_t n_runs,
                             int64_t n_regions, int64_t total, int shift) {
  copy_group_body<V, false>(table.v, table.v + 3 * n_runs, n_regions, total, shift);
}

template <int V>
__global__ void __launch_bounds__(kThreads) copy_cta_kernel(const int64_t* __restrict__ table,
                                                            int64_t n) {
  using Vec = typename VecOf<V>::T;
  constexpr int64_t kTile = int64_t{kThreads} * kIpcUnroll;
  for (int64_t p = blockIdx.x; p < n; p += gridDim.x) {
    Vec* dst = reinterpret_cast<Vec*>(table[3 * p]);
    const Vec* src = reinterpret_cast<const Vec*>(table[3 * p + 1]);
    const int64_t nvec = table[3 * p + 2] / V;
    for (int64_t t0 = 0; t0 < nvec; t0 += kTile) {
      Vec tmp[kIpcUnroll];
#pragma unroll
      for (int u = 0; u < kIpcUnroll; ++u) {
        const int64_t v = t0 + u * kThreads + threadIdx.x;
        if (v < nvec) tmp[u] = __ldcs(src + v);
      }
#pragma unroll
      for (int u = 0; u < kIpcUnroll; ++u) {
        const int64_t v = t0 + u * kThreads + threadIdx.x;
        if (v < nvec) __stcs(dst + v, tmp[u]);
      }
    }
  }
}

namespace {

std::string msg(const char* a) { return std::string(a); }
std::string msg(const char* a, int64_t v, const char* b) {
  return std::string(a) + std::to_string(v) + b;
}

std::string check_table(const at::Tensor& table) {
  if (!table.defined() || !table.device().is_cpu()) {
    return msg("copy_ranges: the range table must be a CPU tensor (it is checked on the host)");
  }
  if (table.scalar_type() != at::kLong || table.dim() != 2 || table.size(1) != 3 ||
      !table.is_contiguous()) {
    return msg("copy_ranges: the range table must be a contiguous int64 (n, 3) tensor");
  }
  return {};
}

// What one pass over the table tells: the vector width and the longest piece, or why not.
struct Scan {
  std::string err;
  int v = 16;
  int64_t longest = 0;
};

Scan scan(const int64_t* rows, int64_t n) {
  Scan s;
  uint64_t bits = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t dst = rows[3 * i], src = rows[3 * i + 1], len = rows[3 * i + 2];
    if (dst == 0 || src == 0) {
      s.err = msg("copy_ranges: piece ", i, " has a null address");
      return s;
    }
    if (len <= 0) {
      s.err = msg("copy_ranges: piece ", i, " is empty or negative");
      return s;
    }
    bits |= static_cast<uint64_t>(dst) | static_cast<uint64_t>(src) | static_cast<uint64_t>(len);
    s.longest = std::max(s.longest, len);
  }
  while (bits % static_cast<uint64_t>(s.v)) s.v >>= 1;
  return s;
}

// Where a launch runs: the stream the caller passed (a cudaStream_t as an integer), or with 0 the
// current stream of `like`'s device (call under a CUDAGuard of it and a CUDAStreamGuard of the
// stream, so the upload queues on it too), and the device's SM count (the default grid caps
// scale with it).
struct Target {
  cudaStream_t stream;
  int sms;
};

c10::cuda::CUDAStream stream_of(c10::DeviceIndex dev, int64_t stream) {
  if (stream == 0) return c10::cuda::getCurrentCUDAStream(dev);
  return c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(stream), dev);
}

c10::cuda::CUDAStream stream_of(const at::Tensor& like, int64_t stream) {
  return stream_of(static_cast<c10::DeviceIndex>(like.device().index()), stream);
}

// The device's SM count, asked of the runtime once per device (a launch of a small pull is on
// its critical path, and every runtime call there costs more than its own work while the
// daemon's caches are cold for it).
int sm_count(c10::DeviceIndex dev) {
  static std::atomic<int> known[64];  // 0: not asked yet (any thread)
  const bool cached = dev >= 0 && dev < 64;
  if (cached) {
    if (const int n = known[dev].load(); n > 0) return n;
  }
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
    return 1;  // not cached: asked again next time
  }
  if (cached) known[dev].store(n);
  return n;
}

Target target(c10::DeviceIndex dev) {
  return Target{c10::cuda::getCurrentCUDAStream(dev).stream(), sm_count(dev)};
}

Target target(const at::Tensor& like) {
  return target(static_cast<c10::DeviceIndex>(like.device().index()));
}

// One upload of `n` table values from pinned memory, ordered on the current stream; the caching
// host allocator keeps the pinned block alive until the copy has run.
at::Tensor upload(const int64_t* rows, int64_t n, const at::Device& device) {
  auto host = at::empty({n}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(rows, rows + n, host.data_ptr<int64_t>());
  auto on_dev = at::empty({n}, at::TensorOptions().dtype(at::kLong).device(device));
  on_dev.copy_(host, /*non_blocking=*/true);
  return on_dev;
}

// Calls f(std::integral_constant<int, V>) for the vector width v (16, 8, 4, 2 or 1), then says
// whether the launch it queued failed; "" on success.
template <typename F>
std::string with_width(const char* op, int v, F&& f) {
  switch (v) {
    case 16: f(std::integral_constant<int, 16>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 1: f(std::integral_constant<int, 1>{}); break;
    default: return std::string(op) + ": bad vector width " + std::to_string(v);
  }
  const cudaError_t launched = cudaGetLastError();
  if (launched != cudaSuccess) {
    return std::string(op) + ": kernel launch failed: " + cudaGetErrorString(launched);
  }
  return {};
}

// Resident CTAs per SM of a stride-kernel instance (registers bound it, not threads).
template <typename K>
int resident(K kernel) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kStrideThreads, 0) !=
          cudaSuccess ||
      per_sm <= 0) {
    per_sm = 1;
  }
  return per_sm;
}

template <int V>
void launch(int64_t variant, const int64_t* d, int64_t n, int64_t longest, int64_t cap,
            int sms, cudaStream_t stream) {
  if (variant == kCtaPerPiece) {
    const int64_t c = cap > 0 ? cap : int64_t{2} * sms;
    const auto grid = static_cast<unsigned>(std::min<int64_t>(std::min<int64_t>(n, c), 65535));
    copy_cta_kernel<V><<<grid, kThreads, 0, stream>>>(d, n);
    return;
  }
  int shift = 0;
  while ((int64_t{1} << shift) < longest / V) ++shift;
  const int64_t total = n << shift;
  const int64_t tiles = (total + int64_t{kStrideThreads} * kIpcUnroll - 1) /
                        (int64_t{kStrideThreads} * kIpcUnroll);
  const int64_t c = cap > 0 ? cap : int64_t{sms} * resident(copy_stride_kernel<V>);
  const auto grid = static_cast<unsigned>(std::min<int64_t>(std::min<int64_t>(tiles, c), 65535));
  copy_stride_kernel<V><<<grid, kStrideThreads, 0, stream>>>(d, total, shift);
}

std::string copy_ranges(at::Tensor table, at::Tensor like, int64_t max_ctas, int64_t variant,
                        int64_t stream) {
  if (auto bad = check_table(table); !bad.empty()) return bad;
  if (!like.defined() || !like.is_cuda()) {
    return msg("copy_ranges: `like` must be a CUDA tensor on the device that copies");
  }
  if (max_ctas < 0) return msg("copy_ranges: max_ctas must be >= 0, got ", max_ctas, "");
  if (variant != kStride && variant != kCtaPerPiece) {
    return msg("copy_ranges: unknown kernel variant ", variant, " (0: stride, 1: CTA per piece)");
  }
  const int64_t n = table.size(0);
  if (n == 0) return {};
  if (n >= std::numeric_limits<int32_t>::max()) {
    return msg("copy_ranges: ", n, " pieces in one launch; split the pull");
  }
  const int64_t* rows = table.data_ptr<int64_t>();
  const Scan s = scan(rows, n);
  if (!s.err.empty()) return s.err;
  // The virtual array of the stride kernel: n slots of the longest piece (a power of two).
  if (s.longest / s.v > (int64_t{1} << 40) / n) {
    return msg("copy_ranges: the pieces span too many vectors for one launch (",
               s.longest, " bytes in the longest piece); cut runs into smaller pieces");
  }
  const c10::cuda::CUDAGuard guard(like.device());
  const c10::cuda::CUDAStreamGuard on_stream(stream_of(like, stream));
  const Target t = target(like);
  const at::Tensor on_dev = upload(rows, 3 * n, like.device());
  const int64_t* d = on_dev.data_ptr<int64_t>();
  return with_width("copy_ranges", s.v, [&](auto w) {
    launch<decltype(w)::value>(variant, d, n, s.longest, max_ctas, t.sms, t.stream);
  });
}

// The grid of a copy_group launch: at most `cap` CTAs in all (0: every resident CTA), a row of
// CTAs per region while the cap allows, else `cap` rows of one CTA each striding over the
// regions.
template <typename K>
dim3 group_grid(K kernel, int64_t total, int64_t n_regions, int64_t cap, int sms) {
  const int64_t tiles = (total + int64_t{kStrideThreads} * kIpcUnroll - 1) /
                        (int64_t{kStrideThreads} * kIpcUnroll);
  const int64_t c = cap > 0 ? cap : int64_t{sms} * resident(kernel);
  const int64_t rows = std::min(n_regions, c);
  const int64_t per_row = std::max<int64_t>(1, c / rows);
  return dim3(static_cast<unsigned>(std::min<int64_t>(std::min(tiles, per_row), 65535)),
              static_cast<unsigned>(rows));
}

template <int V>
void launch_group(const int64_t* runs, const int64_t* bases, int64_t n_runs, int64_t n_regions,
                  int64_t longest, int64_t cap, int sms, cudaStream_t stream) {
  int shift = 0;
  while ((int64_t{1} << shift) < longest / V) ++shift;
  const int64_t total = n_runs << shift;
  const dim3 grid = group_grid(copy_group_kernel<V>, total, n_regions, cap, sms);
  copy_group_kernel<V><<<grid, kStrideThreads, 0, stream>>>(runs, bases, n_regions, total, shift);
}

template <int V, typename Table>
void launch_group_inline(const Table& table, int64_t n_runs, int64_t n_regions,
                         int64_t longest, int64_t cap, int sms, cudaStream_t stream) {
  int shift = 0;
  while ((int64_t{1} << shift) < longest / V) ++shift;
  const int64_t total = n_runs << shift;
  const dim3 grid = group_grid(copy_group_inline_kernel<V, Table>, total, n_regions, cap, sms);
  copy_group_inline_kernel<V, Table>
      <<<grid, kStrideThreads, 0, stream>>>(table, n_runs, n_regions, total, shift);
}

// The table of `numel` values at `rows` as a launch parameter of type Table, launched.
template <typename Table>
std::string launch_inline(const int64_t* rows, int64_t numel, int64_t n_runs, int64_t n_regions,
                          const Scan& s, int64_t max_ctas, const Target& t) {
  Table table;
  std::copy(rows, rows + numel, table.v);
  return with_width("copy_group", s.v, [&](auto w) {
    launch_group_inline<decltype(w)::value, Table>(table, n_runs, n_regions, s.longest, max_ctas,
                                                   t.sms, t.stream);
  });
}

// Whether device `dev` takes launch parameters of up to 32,764 bytes (see kLargeInlineValues):
// the driver's CUDA version and the device's compute capability, asked once per device.
bool large_params(c10::DeviceIndex dev) {
#ifdef KVXFERD_LARGE_PARAMS
  static std::atomic<int> known[64];  // 0: not asked yet, 1: yes, -1: no (any thread)
  if (dev < 0 || dev >= 64) return false;
  if (known[dev].load() == 0) {
    int driver = 0, major = 0;
    const bool ok =
        cudaDriverGetVersion(&driver) == cudaSuccess && driver >= 12010 &&
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
        major >= 7;
    known[dev].store(ok ? 1 : -1);
  }
  return known[dev].load() == 1;
#else
  (void)dev;
  return false;
#endif
}

// copy_group's launch from the table's values (`numel` of them at `rows`, on the host) on
// device `dev`: everything but the tensor checks of the op, shared by the op and the binding.
std::string copy_group_rows(const int64_t* rows, int64_t numel, int64_t n_runs,
                            int64_t n_regions, c10::DeviceIndex dev, int64_t max_ctas,
                            int64_t stream) {
  if (n_runs <= 0 || n_regions <= 0 || n_regions > 65535 || n_runs >= (int64_t{1} << 31)) {
    return msg("copy_group: bad counts (runs ", n_runs, ", regions in 1..65535)");
  }
  if (numel != 3 * n_runs + 2 * n_regions) {
    return msg("copy_group: the table holds ", numel,
               " values; it must hold 3 per run and 2 per region");
  }
  if (max_ctas < 0) return msg("copy_group: max_ctas must be >= 0, got ", max_ctas, "");
  Scan s;  // the runs: offsets from the bases (0 is fine), lengths, alignment
  uint64_t bits = 0;
  for (int64_t i = 0; i < n_runs; ++i) {
    const int64_t dst = rows[3 * i], src = rows[3 * i + 1], len = rows[3 * i + 2];
    if (dst < 0 || src < 0) return msg("copy_group: run ", i, " has a negative offset");
    if (len <= 0) return msg("copy_group: run ", i, " is empty or negative");
    bits |= static_cast<uint64_t>(dst) | static_cast<uint64_t>(src) | static_cast<uint64_t>(len);
    s.longest = std::max(s.longest, len);
  }
  const int64_t* bases = rows + 3 * n_runs;
  for (int64_t r = 0; r < 2 * n_regions; ++r) {
    if (bases[r] == 0) return msg("copy_group: region ", r / 2, " has a null base address");
    bits |= static_cast<uint64_t>(bases[r]);
  }
  while (bits % static_cast<uint64_t>(s.v)) s.v >>= 1;
  if (s.longest / s.v > (int64_t{1} << 40) / n_runs) {
    return msg("copy_group: the runs span too many vectors for one launch (",
               s.longest, " bytes in the longest run); cut runs into smaller pieces");
  }
  const c10::cuda::CUDAGuard guard(dev);
  if (numel <= kInlineValues || (numel <= kLargeInlineValues && large_params(dev))) {
    // The table travels with the launch, which names its stream: nothing else is queued, so
    // no stream guard (its getStreamFromExternal and two stream exchanges).
    const Target t{stream != 0 ? reinterpret_cast<cudaStream_t>(stream)
                               : c10::cuda::getCurrentCUDAStream(dev).stream(),
                   sm_count(dev)};
    if (numel <= kInlineValues) {
      return launch_inline<InlineTable>(rows, numel, n_runs, n_regions, s, max_ctas, t);
    }
#ifdef KVXFERD_LARGE_PARAMS
    return launch_inline<LargeInlineTable>(rows, numel, n_runs, n_regions, s, max_ctas, t);
#endif
  }
  const c10::cuda::CUDAStreamGuard on_stream(stream_of(dev, stream));  // the upload's stream
  const Target t = target(dev);
  const at::Tensor on_dev = upload(rows, numel, at::Device(at::kCUDA, dev));
  const int64_t* d = on_dev.data_ptr<int64_t>();
  return with_width("copy_group", s.v, [&](auto w) {
    launch_group<decltype(w)::value>(d, d + 3 * n_runs, n_runs, n_regions, s.longest, max_ctas,
                                     t.sms, t.stream);
  });
}

std::string copy_group(at::Tensor table, int64_t n_runs, int64_t n_regions, at::Tensor like,
                       int64_t max_ctas, int64_t stream) {
  if (!table.defined() || !table.device().is_cpu() || table.scalar_type() != at::kLong ||
      table.dim() != 1 || !table.is_contiguous()) {
    return msg("copy_group: the table must be a contiguous 1-D int64 CPU tensor");
  }
  if (!like.defined() || !like.is_cuda()) {
    return msg("copy_group: `like` must be a CUDA tensor on the device that copies");
  }
  return copy_group_rows(table.data_ptr<int64_t>(), table.numel(), n_runs, n_regions,
                         static_cast<c10::DeviceIndex>(like.device().index()), max_ctas, stream);
}

// Which vector width a table would use (tests and the bench's log); 0 for a bad table.
int64_t copy_vector_width(at::Tensor table) {
  if (!check_table(table).empty()) return 0;
  const Scan s = scan(table.data_ptr<int64_t>(), table.size(0));
  return s.err.empty() ? s.v : 0;
}

}  // namespace

// copy_group for the Python binding (cuda/bindings.cpp): the table as the address of its
// `numel` int64 values in host memory (a contiguous CPU tensor's data_ptr(), which the caller
// keeps alive for the call; the values are copied into the launch or a pinned upload before it
// returns) and the device as its index. Called as a plain function, not through the dispatcher:
// a small pull's launch is one such call.
std::string copy_group_raw(int64_t table, int64_t numel, int64_t n_runs, int64_t n_regions,
                           int64_t device, int64_t max_ctas, int64_t stream) {
  if (table == 0) return msg("copy_group: the table's address is null");
  static std::atomic<int> devices{0};  // the device count, once the runtime gave it
  int count = devices.load();
  if (count == 0) {
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    if (count > 0) devices.store(count);
  }
  if (device < 0 || device >= count) {
    return msg("copy_group: no CUDA device ", device, " here");
  }
  return copy_group_rows(reinterpret_cast<const int64_t*>(table), numel, n_runs, n_regions,
                         static_cast<c10::DeviceIndex>(device), max_ctas, stream);
}

}  // namespace kvxferd

TORCH_LIBRARY_FRAGMENT(kvxferd, m) {
  m.def(
      "copy_ranges(Tensor table, Tensor like, int max_ctas, int variant, int stream=0) -> str",
      &kvxferd::copy_ranges);
  m.def("copy_vector_width(Tensor table) -> int", &kvxferd::copy_vector_width);
  m.def(
      "copy_group(Tensor table, int n_runs, int n_regions, Tensor like, int max_ctas,"
      " int stream=0) -> str",
      &kvxferd::copy_group);
}
