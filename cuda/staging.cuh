// Staging kernels: gather a request's scattered KV blocks into one contiguous buffer, scatter
// them back into place, optionally swapping tokens and heads (NHD <-> HND) in the same pass.
//
// Plain CUDA C++, no torch: the launcher in staging.cu checks every input and calls these.
//
// Geometry. Region r is `num_blocks` blocks of `len` bytes, block b at `base + b * stride`.
// The staging buffer of a request of n block IDs is n rows of `row_bytes` bytes; row i is the
// concatenation, over regions in order, of region r's block ids[i] (at `row_off` in the row).
// So the staging buffer is the request in cross-layer form, whatever the chunking.
//
// Work split. One CUDA block copies one tile (THREADS * UNROLL vectors of V bytes) of one piece
// (row i, region r): blockIdx.x = i * n_regions + r, blockIdx.y strides over the tiles. Every
// thread issues UNROLL independent loads before its first store. Loads and stores are
// streaming (.cs): every byte is touched once.
//
// Permute. Inside each "half" (half_bytes = A * B * unit bytes: one K or V half of one layer)
// the source holds an A x B matrix of `unit`-byte items (a head vector), the destination its
// B x A transpose. NHD -> HND: A = block_size, B = num_heads, unit = head_bytes; HND -> NHD:
// A = num_heads, B = block_size. Threads walk the destination (coalesced stores) and compute the
// source offset; V always divides `unit`, so a vector never straddles two items.
#pragma once

#include <cstdint>

namespace kvxferd {

struct RegionRow {  // one row of the device table (int64 x 5, in this order)
  int64_t base;
  int64_t len;
  int64_t stride;
  int64_t num_blocks;
  int64_t row_off;
};

struct PermuteArgs {  // all zero: no permute
  uint32_t a;
  uint32_t b;
  uint32_t unit;
  uint32_t half;
};

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <int V> struct VecOf;
template <> struct VecOf<16> { using T = uint4; };
template <> struct VecOf<8> { using T = uint2; };
template <> struct VecOf<4> { using T = unsigned int; };
template <> struct VecOf<2> { using T = unsigned short; };
template <> struct VecOf<1> { using T = unsigned char; };

__device__ __forceinline__ uint32_t permuted_offset(uint32_t o, const PermuteArgs& p) {
  // o: byte offset in the destination block; returns the matching source offset.
  const uint32_t h = o / p.half;
  const uint32_t rem = o - h * p.half;
  const uint32_t item = rem / p.unit;  // destination item: row-major in B x A
  const uint32_t w = rem - item * p.unit;
  const uint32_t bi = item / p.a;
  const uint32_t ai = item - bi * p.a;
  return h * p.half + (ai * p.b + bi) * p.unit + w;  // source item: row-major in A x B
}

// GATHER: region blocks -> staging rows. !GATHER (scatter): staging rows -> region blocks.
template <int V, bool PERMUTE, bool GATHER>
__global__ void __launch_bounds__(kThreads) copy_blocks_kernel(
    const RegionRow* __restrict__ table, int n_regions, const int64_t* __restrict__ ids,
    int64_t row_bytes, uint8_t* __restrict__ staging, PermuteArgs perm) {
  using Vec = typename VecOf<V>::T;
  const int64_t piece = blockIdx.x;
  const int64_t i = piece / n_regions;
  const int r = static_cast<int>(piece - i * n_regions);
  const RegionRow reg = table[r];
  const int64_t id = ids[i];
  // The launcher checked every ID on the host; this guard only makes it impossible for any
  // caller to reach memory outside a region.
  if (id < 0 || id >= reg.num_blocks) return;
  uint8_t* block = reinterpret_cast<uint8_t*>(reg.base) + id * reg.stride;
  uint8_t* row = staging + i * row_bytes + reg.row_off;
  const uint8_t* src = GATHER ? block : row;
  uint8_t* dst = GATHER ? row : block;
  const uint32_t nvec = static_cast<uint32_t>(reg.len / V);
  constexpr uint32_t kTile = kThreads * kUnroll;
  for (uint32_t t0 = blockIdx.y * kTile; t0 < nvec; t0 += gridDim.y * kTile) {
    Vec tmp[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t v = t0 + u * kThreads + threadIdx.x;
      if (v < nvec) {
        const uint32_t o = v * V;
        const uint32_t so = PERMUTE ? permuted_offset(o, perm) : o;
        tmp[u] = __ldcs(reinterpret_cast<const Vec*>(src + so));
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t v = t0 + u * kThreads + threadIdx.x;
      if (v < nvec) __stcs(reinterpret_cast<Vec*>(dst + static_cast<size_t>(v) * V), tmp[u]);
    }
  }
}

}  // namespace kvxferd
