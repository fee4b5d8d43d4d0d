// KERNEL pulls: copy a pull's byte ranges (its (region, block run) pieces) with SM loads and
// stores, in one launch, from memory another process exported over CUDA IPC into our pool.
//
// Op (namespace `kvxferd`, a fragment of the library that staging.cu defines; built into the
// same extension by kvxferd.kernels.loader):
//   kvxferd::copy_ranges(Tensor table, Tensor like, int max_ctas) -> str
// table: CPU int64 tensor (n, 3), contiguous: one row [dst_addr, src_addr, nbytes] per piece;
// like: any CUDA tensor on the device that runs the copy (work is queued on its current stream);
// max_ctas: cap on the grid (0: two CTAs per multiprocessor). Every address must be usable on
// that device: its own memory, or memory mapped into its context (cuIpcOpenMemHandle). This op
// cannot know the mapped sizes: the caller (kvxferd.kernels.cuda_ops.copy_ranges) checks every
// piece against its region before calling.
//
// Work split. The grid is persistent: CTA b copies pieces b, b + grid, b + 2 grid, ... Each
// piece is moved by all threads of the CTA in tiles of kThreads * kIpcUnroll vectors of V bytes
// (V = 16 when every address and length allows it); every thread issues kIpcUnroll independent
// loads before its first store, and loads and stores are streaming (.cs): each byte is touched
// once. The host cuts long ranges into pieces (kvxferd.ipc.reader.PIECE_BYTES) so that a few
// large runs still spread over the whole grid.
//
// Measured (docs/benchmarks.md, one H100, 1 GiB): 383 GB/s for 64 KiB random pieces and 681
// GB/s for contiguous 256 KiB pieces, 0.27 / 0.47 of the raw copy: below the goal. One warp per
// piece (512-thread CTAs, 64 KiB pieces) measured worse (317 / 348 GB/s) and was reverted. Both
// keep thousands of pieces in flight at 64 KiB-aligned addresses that advance in lockstep;
// the untested next step is a grid-stride over the concatenated pieces (fixed-size pieces,
// consecutive threads on consecutive vectors), the raw copy's access pattern.
//
// Errors: "" on success or a message, as in staging.cu (and for the same reason: no
// TORCH_CHECK with numbers; see the comment there).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>

#include "staging.cuh"

namespace kvxferd {

constexpr int kIpcUnroll = 8;

template <int V>
__global__ void __launch_bounds__(kThreads) copy_ranges_kernel(const int64_t* __restrict__ table,
                                                               int64_t n) {
  using Vec = typename VecOf<V>::T;
  constexpr int64_t kTile = int64_t{kThreads} * kIpcUnroll;
  for (int64_t p = blockIdx.x; p < n; p += gridDim.x) {
    const int64_t dst_addr = table[3 * p];
    const int64_t src_addr = table[3 * p + 1];
    const int64_t nvec = table[3 * p + 2] / V;
    Vec* dst = reinterpret_cast<Vec*>(dst_addr);
    const Vec* src = reinterpret_cast<const Vec*>(src_addr);
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

std::string copy_ranges(at::Tensor table, at::Tensor like, int64_t max_ctas) {
  if (!table.defined() || !table.device().is_cpu()) {
    return msg("copy_ranges: the range table must be a CPU tensor (it is checked on the host)");
  }
  if (table.scalar_type() != at::kLong || table.dim() != 2 || table.size(1) != 3 ||
      !table.is_contiguous()) {
    return msg("copy_ranges: the range table must be a contiguous int64 (n, 3) tensor");
  }
  if (!like.defined() || !like.is_cuda()) {
    return msg("copy_ranges: `like` must be a CUDA tensor on the device that copies");
  }
  if (max_ctas < 0) return msg("copy_ranges: max_ctas must be >= 0, got ", max_ctas, "");
  const int64_t n = table.size(0);
  if (n == 0) return {};
  if (n >= std::numeric_limits<int32_t>::max()) {
    return msg("copy_ranges: ", n, " pieces in one launch; split the pull");
  }
  const int64_t* rows = table.data_ptr<int64_t>();
  int64_t align = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t dst = rows[3 * i], src = rows[3 * i + 1], len = rows[3 * i + 2];
    if (dst == 0 || src == 0) return msg("copy_ranges: piece ", i, " has a null address");
    if (len <= 0) return msg("copy_ranges: piece ", i, " is empty or negative");
    align = std::gcd(std::gcd(std::gcd(align, dst), src), len);
  }
  int v = 16;
  while (align % v) v >>= 1;
  const c10::cuda::CUDAGuard guard(like.device());
  const int dev = like.device().index();
  cudaStream_t stream =
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(dev)).stream();
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) {
    sms = 1;
  }
  const int64_t cap = max_ctas > 0 ? max_ctas : int64_t{2} * sms;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(std::min<int64_t>(n, cap), 65535));
  // One upload of the table from pinned memory, ordered on this stream; the caching host
  // allocator keeps the pinned block alive until the copy has run.
  auto host = at::empty({n, 3}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(rows, rows + 3 * n, host.data_ptr<int64_t>());
  auto on_dev = at::empty({n, 3}, at::TensorOptions().dtype(at::kLong).device(like.device()));
  on_dev.copy_(host, /*non_blocking=*/true);
  const int64_t* d = on_dev.data_ptr<int64_t>();
  switch (v) {
#define KVX_CASE(W)                                                        \
  case W:                                                                  \
    copy_ranges_kernel<W><<<grid, kThreads, 0, stream>>>(d, n);            \
    break;
    KVX_CASE(16)
    KVX_CASE(8)
    KVX_CASE(4)
    KVX_CASE(2)
    KVX_CASE(1)
#undef KVX_CASE
    default:
      return msg("copy_ranges: bad vector width ", v, "");
  }
  const cudaError_t launched = cudaGetLastError();
  if (launched != cudaSuccess) {
    return std::string("copy_ranges: kernel launch failed: ") + cudaGetErrorString(launched);
  }
  return {};
}

// Which vector width a table would use (tests and the bench's log).
int64_t copy_vector_width(at::Tensor table) {
  if (!table.defined() || table.scalar_type() != at::kLong || table.dim() != 2 ||
      table.size(1) != 3 || !table.is_contiguous() || !table.device().is_cpu()) {
    return 0;
  }
  const int64_t* rows = table.data_ptr<int64_t>();
  int64_t align = 0;
  for (int64_t i = 0; i < table.size(0); ++i) {
    align = std::gcd(std::gcd(std::gcd(align, rows[3 * i]), rows[3 * i + 1]), rows[3 * i + 2]);
  }
  int64_t v = 16;
  while (align % v) v >>= 1;
  return v;
}

}  // namespace
}  // namespace kvxferd

TORCH_LIBRARY_FRAGMENT(kvxferd, m) {
  m.def("copy_ranges(Tensor table, Tensor like, int max_ctas) -> str", &kvxferd::copy_ranges);
  m.def("copy_vector_width(Tensor table) -> int", &kvxferd::copy_vector_width);
}
