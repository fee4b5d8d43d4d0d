// Launchers and torch op registration for the staging kernels (staging.cuh).
//
// Ops (namespace `kvxferd`, loaded by kvxferd.kernels with torch.utils.cpp_extension.load):
//   kvxferd::gather_blocks(Tensor[] regions, Tensor ids, Tensor(a!) out, int[] permute) -> str
//   kvxferd::scatter_blocks(Tensor(a!)[] regions, Tensor ids, Tensor staging, int[] permute) -> str
// regions: 2-D uint8 CUDA views (num_blocks, block_len) with strides (block_stride, 1), all on
// the device of `out`/`staging`; ids: 1-D int64 CPU tensor (checked here, on the host, against
// every region's num_blocks before anything is launched); out/staging: contiguous uint8 CUDA
// tensor of exactly len(ids) * sum(block_len) bytes; permute: [] or [A, B, unit_bytes] (see
// staging.cuh). Work is queued on the current CUDA stream of that device.
//
// Errors: every op returns "" on success and a message on refused input or a failed launch,
// and nothing runs when the input is refused; the Python wrapper raises the typed error.
// Messages are built with std::string and std::to_string only, never c10::str or TORCH_CHECK
// with numbers: on the lent H200 image (torch 2.11.0+cu130, nvcc 13.0 with /opt/gcc) a
// TORCH_CHECK(false, "text ", int64_t{42}) in nvcc-compiled host code killed the process with
// SIGSEGV, while TORCH_CHECK(false, "text") raised RuntimeError normally (2026-11-21, probe:
// python -m bench.gpu_staging --probe-exceptions). Cause not established.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <numeric>
#include <vector>

#include "staging.cuh"

namespace kvxferd {
namespace {

inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, at::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, const c10::Device& v) { s += v.str(); }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append(std::string& s, T v) {
  s += std::to_string(v);
}
template <typename... Args>
std::string msg(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

// Return a message from the enclosing function (which returns std::string) unless `cond`.
#define KVX_REQUIRE(cond, ...)              \
  do {                                      \
    if (!(cond)) return msg(__VA_ARGS__);   \
  } while (0)

struct Prepared {
  std::vector<int64_t> host;  // table (n_regions x 5) then the ids
  int64_t row_bytes = 0;
  int64_t max_len = 0;
  int64_t align = 0;  // gcd of every address, length, stride and offset: picks the vector width
};

int64_t gcd64(int64_t a, int64_t b) { return std::gcd(a, b); }

std::string check_and_prepare(const std::vector<at::Tensor>& regions, const at::Tensor& ids,
                              const at::Tensor& staging, const std::vector<int64_t>& permute,
                              const char* what, Prepared& p) {
  KVX_REQUIRE(!regions.empty(), what, ": no regions");
  KVX_REQUIRE(staging.defined() && staging.is_cuda(), what, ": staging must be a CUDA tensor");
  KVX_REQUIRE(staging.scalar_type() == at::kByte, what, ": staging must be uint8, got ",
              staging.scalar_type());
  KVX_REQUIRE(staging.is_contiguous(), what, ": staging must be contiguous");
  KVX_REQUIRE(ids.defined() && ids.device().is_cpu(), what,
              ": block IDs must be a CPU tensor (they are checked on the host)");
  KVX_REQUIRE(ids.scalar_type() == at::kLong, what, ": block IDs must be int64, got ",
              ids.scalar_type());
  KVX_REQUIRE(ids.dim() == 1 && ids.is_contiguous(), what, ": block IDs must be 1-D contiguous");
  KVX_REQUIRE(permute.empty() || permute.size() == 3, what,
              ": permute must be [] or [A, B, unit_bytes], got ", permute.size(), " values");
  int64_t half = 0;
  if (!permute.empty()) {
    for (int64_t p : permute) KVX_REQUIRE(p > 0, what, ": permute values must be positive");
    half = permute[0] * permute[1] * permute[2];
    KVX_REQUIRE(half < (int64_t{1} << 31), what, ": permute half too large");
  }
  const auto dev = staging.device();
  const int64_t n_regions = static_cast<int64_t>(regions.size());
  const int64_t n = ids.numel();
  p.host.resize(n_regions * 5 + n);
  p.align = reinterpret_cast<int64_t>(staging.data_ptr());
  int64_t min_blocks = std::numeric_limits<int64_t>::max();
  int64_t min_region = 0;
  for (int64_t r = 0; r < n_regions; ++r) {
    const at::Tensor& t = regions[r];
    KVX_REQUIRE(t.defined() && t.is_cuda() && t.device() == dev, what, ": region ", r,
                " must be a CUDA tensor on ", dev);
    KVX_REQUIRE(t.scalar_type() == at::kByte, what, ": region ", r, " must be a uint8 view");
    KVX_REQUIRE(t.dim() == 2, what, ": region ", r, " must be 2-D (num_blocks, block_len)");
    const int64_t nb = t.size(0), len = t.size(1), stride = t.stride(0);
    KVX_REQUIRE(nb > 0 && len > 0, what, ": region ", r, " is empty");
    KVX_REQUIRE(t.stride(1) == 1, what, ": region ", r, " blocks must be contiguous");
    KVX_REQUIRE(stride >= len, what, ": region ", r, " blocks overlap (stride ", stride,
                " < block_len ", len, ")");
    KVX_REQUIRE(len < (int64_t{1} << 32), what, ": region ", r, " block_len too large");
    if (half) {
      KVX_REQUIRE(len % half == 0, what, ": region ", r, " block_len ", len,
                  " is not a multiple of the permute half (", half, " bytes)");
    }
    const int64_t base = reinterpret_cast<int64_t>(t.data_ptr());
    int64_t* row = p.host.data() + r * 5;
    row[0] = base;
    row[1] = len;
    row[2] = stride;
    row[3] = nb;
    row[4] = p.row_bytes;
    p.align = gcd64(gcd64(gcd64(gcd64(p.align, base), len), stride), p.row_bytes);
    p.row_bytes += len;
    p.max_len = std::max(p.max_len, len);
    if (nb < min_blocks) {
      min_blocks = nb;
      min_region = r;
    }
  }
  if (!permute.empty()) p.align = gcd64(p.align, permute[2]);
  p.align = gcd64(p.align, p.row_bytes);
  KVX_REQUIRE(staging.numel() == n * p.row_bytes, what, ": staging has ", staging.numel(),
              " bytes, expected ", n, " block IDs x ", p.row_bytes, " bytes");
  const int64_t* src = ids.data_ptr<int64_t>();
  int64_t* dst = p.host.data() + n_regions * 5;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = src[i];
    KVX_REQUIRE(id >= 0 && id < min_blocks, what, ": block ID ", id, " at index ", i,
                " is outside region ", min_region, " (", min_blocks, " blocks)");
    dst[i] = id;
  }
  KVX_REQUIRE(n * n_regions < std::numeric_limits<int32_t>::max(), what,
              ": too many (block, region) pieces in one launch; split the request in chunks");
  return {};
}

template <bool PERMUTE, bool GATHER>
std::string launch_v(int v, dim3 grid, cudaStream_t s, const RegionRow* table, int n_regions,
              const int64_t* ids, int64_t row_bytes, uint8_t* staging, PermuteArgs perm) {
  switch (v) {
#define KVX_CASE(W)                                                                     \
  case W:                                                                               \
    copy_blocks_kernel<W, PERMUTE, GATHER>                                              \
        <<<grid, kThreads, 0, s>>>(table, n_regions, ids, row_bytes, staging, perm);   \
    break;
    KVX_CASE(16)
    KVX_CASE(8)
    KVX_CASE(4)
    KVX_CASE(2)
    KVX_CASE(1)
#undef KVX_CASE
    default:
      return msg("bad vector width ", v);
  }
  return {};
}

std::string run(const std::vector<at::Tensor>& regions, const at::Tensor& ids,
                const at::Tensor& staging, const std::vector<int64_t>& permute, bool gather) {
  const char* what = gather ? "gather_blocks" : "scatter_blocks";
  Prepared p;
  std::string err = check_and_prepare(regions, ids, staging, permute, what, p);
  if (!err.empty()) return err;
  const int64_t n = ids.numel();
  if (n == 0) return {};
  const int n_regions = static_cast<int>(regions.size());
  const c10::cuda::CUDAGuard guard(staging.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(staging.device().index()).stream();
  // One small upload per launch (table + IDs) from pinned memory, ordered on this stream; the
  // caching host allocator keeps the pinned block alive until the copy has run.
  auto host = at::empty({static_cast<int64_t>(p.host.size())},
                        at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(p.host.begin(), p.host.end(), host.data_ptr<int64_t>());
  auto dev = at::empty({static_cast<int64_t>(p.host.size())},
                       at::TensorOptions().dtype(at::kLong).device(staging.device()));
  dev.copy_(host, /*non_blocking=*/true);
  const int64_t* d = dev.data_ptr<int64_t>();
  const auto* table = reinterpret_cast<const RegionRow*>(d);
  const int64_t* d_ids = d + static_cast<int64_t>(n_regions) * 5;
  int v = 16;
  while (p.align % v) v >>= 1;
  PermuteArgs perm{0, 0, 0, 0};
  if (!permute.empty()) {
    perm.a = static_cast<uint32_t>(permute[0]);
    perm.b = static_cast<uint32_t>(permute[1]);
    perm.unit = static_cast<uint32_t>(permute[2]);
    perm.half = perm.a * perm.b * perm.unit;
  }
  const int64_t tiles = (p.max_len / v + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  dim3 grid(static_cast<unsigned>(n * n_regions),
            static_cast<unsigned>(std::min<int64_t>(tiles, 65535)));
  auto* out = staging.data_ptr<uint8_t>();
  const auto* t = table;
  const int64_t rb = p.row_bytes;
  if (permute.empty()) {
    err = gather ? launch_v<false, true>(v, grid, stream, t, n_regions, d_ids, rb, out, perm)
                 : launch_v<false, false>(v, grid, stream, t, n_regions, d_ids, rb, out, perm);
  } else {
    err = gather ? launch_v<true, true>(v, grid, stream, t, n_regions, d_ids, rb, out, perm)
                 : launch_v<true, false>(v, grid, stream, t, n_regions, d_ids, rb, out, perm);
  }
  if (!err.empty()) return err;
  const cudaError_t launched = cudaGetLastError();
  if (launched != cudaSuccess) {
    return msg(what, ": kernel launch failed: ", cudaGetErrorString(launched));
  }
  return {};
}

std::string gather_blocks(std::vector<at::Tensor> regions, at::Tensor ids, at::Tensor out,
                          std::vector<int64_t> permute) {
  return run(regions, ids, out, permute, /*gather=*/true);
}

std::string scatter_blocks(std::vector<at::Tensor> regions, at::Tensor ids, at::Tensor staging,
                           std::vector<int64_t> permute) {
  return run(regions, ids, staging, permute, /*gather=*/false);
}

// Which vector width a call would use (for tests and the bench's log); 0 when refused.
int64_t vector_width(std::vector<at::Tensor> regions, at::Tensor ids, at::Tensor staging,
                     std::vector<int64_t> permute) {
  Prepared p;
  if (!check_and_prepare(regions, ids, staging, permute, "vector_width", p).empty()) return 0;
  int64_t v = 16;
  while (p.align % v) v >>= 1;
  return v;
}

}  // namespace
}  // namespace kvxferd

TORCH_LIBRARY(kvxferd, m) {
  m.def("gather_blocks(Tensor[] regions, Tensor ids, Tensor(a!) out, int[] permute) -> str",
        &kvxferd::gather_blocks);
  m.def("scatter_blocks(Tensor(a!)[] regions, Tensor ids, Tensor staging, int[] permute) -> str",
        &kvxferd::scatter_blocks);
  m.def("vector_width(Tensor[] regions, Tensor ids, Tensor staging, int[] permute) -> int",
        &kvxferd::vector_width);
}
