"""Heterogeneous kernel block sizes: pairing and byte ranges at the smaller kernel block.

When the two sides' kernel block sizes differ (docs/domain.md §5, rule 3), a 1:1 pairing of
kernel blocks no longer pairs equal tokens, and one side's kernel block is laid out differently
inside from the other's several (each K/V half, and each head of an HND half, holds the
block's tokens contiguously). kvxferd then works at the **chunk**: ``c`` tokens, ``c`` the
smaller kernel block size, which the larger must be a multiple of (``r = large // c``).

* Pairing. Both groups are re-expressed with kernel block size ``c`` (logical sizes
  unchanged), and the ordinary rules of :func:`~kvxferd.blocks.trim.pair_group` pair chunk IDs;
  on the side whose kernel block is ``r`` chunks, chunk ``q`` is sub-block ``q % r`` of kernel
  block ``q // r``. With equal logical block sizes the chunk ratios are equal, so prefix
  caching's end-trim still applies; with different logical sizes the rules for different
  ``ppl`` apply (prefix caching off only).
* Bytes. A region's block is a sequence of *columns* (one per K/V half and layer; one per
  (half, layer, head) for head-major layouts; one for MLA), each holding the block's tokens as
  rows of equal bytes. Chunk ``s`` of a kernel block occupies rows ``[s*c, (s+1)*c)`` of every
  column, so each (chunk pair, column) is one contiguous range on both sides. TP head slices
  combine with this for head-major layouts exactly as in :mod:`.tp`.

The number of ranges is ``chunk pairs x columns`` before merging (adjacent ranges on both
sides merge); that is the price of re-blocking by byte ranges instead of a kernel, and it is
what the plan's descriptor counts report.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.ranges import Int64Array, RegionRanges
from kvxferd.blocks.tp import (
    TPPosition,
    check_tp,
    head_sources,
    infer_num_kv_heads,
    kv_head_range,
    require_same,
    tp_ratio,
)
from kvxferd.blocks.trim import pair_group
from kvxferd.errors import InvalidRequest, SpecError
from kvxferd.layout.spec import KVGroup, Layout, Region


def compatible_kernel_sizes(kernel_block_size: int, logical_block_size: int) -> list[int]:
    """Kernel block sizes a peer may use against ``kernel_block_size`` here: those dividing
    ``logical_block_size`` (the peer's logical block) that divide or are divided by ours."""
    return [
        s
        for s in range(1, logical_block_size + 1)
        if logical_block_size % s == 0
        and max(s, kernel_block_size) % min(s, kernel_block_size) == 0
    ]


def chunk_tokens(local: KVGroup, remote: KVGroup, *, field: str = "") -> int:
    """The chunk size (the smaller kernel block size) of a group pair; raises
    :class:`SpecError` naming the sizes that would work when neither divides the other."""
    a, b = local.kernel_block_size, remote.kernel_block_size
    small, large = min(a, b), max(a, b)
    if large % small:
        works = compatible_kernel_sizes(a, remote.logical_block_size)
        raise SpecError(
            f"group {local.name!r}: kernel block sizes {a} (local) and {b} (remote) tokens are"
            " not multiples of one another, so no chunk of tokens tiles both",
            fix=f"run the remote with a kernel block size in {works} (it must divide its logical"
            f" block size {remote.logical_block_size} and divide or be a multiple of {a})",
            field=field,
        )
    return small


@dataclass(frozen=True)
class ChunkPairs:
    """Paired chunks of one group: pair ``i`` moves sub-block ``local_sub[i]`` of local kernel
    block ``local_kernel[i]`` and sub-block ``remote_sub[i]`` of remote kernel block
    ``remote_kernel[i]``; each sub-block is ``tokens`` tokens. Sorted by local position."""

    tokens: int
    local_kernel: Int64Array
    local_sub: Int64Array
    remote_kernel: Int64Array
    remote_sub: Int64Array

    @property
    def num_pairs(self) -> int:
        return int(self.local_kernel.shape[0])


def _split(chunks: Int64Array, per_kernel: int) -> tuple[Int64Array, Int64Array]:
    return chunks // per_kernel, chunks % per_kernel


def pair_chunks(
    local: KVGroup,
    remote: KVGroup,
    local_logical_ids: npt.ArrayLike,
    remote_logical_ids: npt.ArrayLike,
    *,
    prefix_caching: bool,
    field: str = "",
) -> ChunkPairs:
    """Pair one attention group's logical IDs at the chunk (see the module docstring)."""
    c = chunk_tokens(local, remote, field=field)
    if prefix_caching and local.logical_block_size != remote.logical_block_size:
        raise InvalidRequest(
            f"group {local.name!r}: kernel block sizes differ (local {local.kernel_block_size},"
            f" remote {remote.kernel_block_size} tokens) and so do the logical block sizes"
            f" (local {local.logical_block_size}, remote {remote.logical_block_size} tokens)"
            " while prefix caching is on; the cached prefix cannot be aligned",
            field=field or "groups",
            fix="disable prefix caching on both peers, or give them equal logical block sizes",
        )
    lq, rq = pair_group(
        KVGroup(local.name, local.kind, local.logical_block_size, c),
        KVGroup(remote.name, remote.kind, remote.logical_block_size, c),
        local_logical_ids,
        remote_logical_ids,
        prefix_caching=prefix_caching,
        field=field,
    )
    lk, ls = _split(lq, local.kernel_block_size // c)
    rk, rs = _split(rq, remote.kernel_block_size // c)
    order = np.lexsort((ls, lk))
    return ChunkPairs(c, lk[order], ls[order], rk[order], rs[order])


@dataclass(frozen=True)
class ChunkSegments:
    """For one remote rank and region pair: each column's start inside a kernel block on both
    sides, and the bytes of one chunk of one column (``row_bytes * tokens``). Sub-block ``s``
    of a kernel block starts ``s * length`` bytes further into every column."""

    remote_rank: int
    local_base: Int64Array
    remote_base: Int64Array
    length: int


def chunk_segments(
    local: Region,
    remote: Region,
    tokens: int,
    *,
    local_tp: TPPosition = (0, 1),
    remote_tp: TPPosition = (0, 1),
    num_kv_heads: int | None = None,
    field: str = "",
) -> tuple[ChunkSegments, ...]:
    """Per remote rank to read, the column layout of one region pair at ``tokens`` per chunk."""
    check_tp(local_tp, "local_tp")
    check_tp(remote_tp, "remote_tp")
    l_rank, l_size = local_tp
    r_size = remote_tp[1]
    tp_ratio(l_size, r_size)
    require_same(local, remote, "layout", local.layout.value, remote.layout.value, field=field)
    require_same(local, remote, "dtype", local.dtype.value, remote.dtype.value, field=field)
    tl, tr = local.tokens_per_block, remote.tokens_per_block
    if tl % tokens or tr % tokens:
        raise InvalidRequest(
            f"region {local.name!r}: {tokens}-token chunks do not tile blocks of {tl} (local)"
            f" and {tr} (remote) tokens",
            field=field,
            fix="the regions' tokens per block must be the groups' kernel block sizes",
        )
    if local.layout is Layout.MLA:
        require_same(local, remote, "latent size", local.shape[2], remote.shape[2], field=field)
        row = local.shape[2] * local.dtype.itemsize
        z = np.zeros(1, dtype=np.int64)
        return (ChunkSegments(l_rank % r_size, z, z.copy(), tokens * row),)
    if not local.layout.has_kv_halves:
        raise InvalidRequest(
            f"region {local.name!r} is {local.layout.value}: it holds no tokens to re-block",
            field=field,
            fix="only token groups (attention, MLA) re-block; states pair whole",
        )
    require_same(local, remote, "layers", local.num_layers, remote.num_layers, field=field)
    require_same(local, remote, "head size", local.head_size, remote.head_size, field=field)
    total = num_kv_heads or infer_num_kv_heads(
        local.num_kv_heads, l_size, remote.num_kv_heads, r_size, field=field
    )
    l_first, l_count = kv_head_range(l_rank, l_size, total)
    r_count = kv_head_range(0, r_size, total)[1]
    require_same(local, remote, "local heads per rank", local.num_kv_heads, l_count, field=field)
    require_same(local, remote, "remote heads per rank", remote.num_kv_heads, r_count, field=field)
    halves = np.arange(2 * local.num_layers, dtype=np.int64)
    itemsize = local.dtype.itemsize
    out = []
    for hs in head_sources(l_rank, l_size, r_size, total):
        r_first = kv_head_range(hs.remote_rank, r_size, total)[0]
        whole = hs.first_head == l_first == r_first and hs.count == l_count == r_count
        if not local.layout.head_major:
            if not whole:
                raise InvalidRequest(
                    f"region {local.name!r} is {local.layout.value}: a {l_count}-head slice"
                    f" of TP {l_size} cannot be read from a TP {r_size} peer's blocks because"
                    " one head's tokens are not contiguous",
                    field=field,
                    fix="register the KV cache head-major (HND / CROSS_LAYER_HND) on both"
                    " peers, or run equal TP sizes",
                )
            row = l_count * local.head_size * itemsize
            out.append(
                ChunkSegments(hs.remote_rank, halves * tl * row, halves * tr * row, tokens * row)
            )
            continue
        row = local.head_size * itemsize
        heads = np.arange(hs.first_head, hs.first_head + hs.count, dtype=np.int64)
        lcol = (halves[:, None] * l_count + (heads - l_first)[None, :]).reshape(-1)
        rcol = (halves[:, None] * r_count + (heads - r_first)[None, :]).reshape(-1)
        out.append(ChunkSegments(hs.remote_rank, lcol * tl * row, rcol * tr * row, tokens * row))
    return tuple(sorted(out, key=lambda s: s.remote_rank))


def merge_adjacent(
    loc: Int64Array, rem: Int64Array, length: Int64Array
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """Merge consecutive ranges that are contiguous on both sides (vectorised)."""
    n = length.shape[0]
    if n < 2:
        return loc, rem, length
    end_l, end_r = loc[:-1] + length[:-1], rem[:-1] + length[:-1]
    brk = np.flatnonzero((end_l != loc[1:]) | (end_r != rem[1:])) + 1
    starts = np.concatenate((np.zeros(1, dtype=np.int64), brk))
    sums = np.add.reduceat(length, starts)
    return loc[starts], rem[starts], sums.astype(np.int64)


def chunk_ranges(
    pairs: ChunkPairs,
    seg: ChunkSegments,
    *,
    region: int,
    name: str,
    local_stride: int,
    remote_stride: int,
) -> RegionRanges:
    """Byte ranges of one region pair for one remote rank: one per (chunk pair, column),
    ordered by local position then column, merged where contiguous on both sides."""
    lstart = pairs.local_kernel * local_stride + pairs.local_sub * seg.length
    rstart = pairs.remote_kernel * remote_stride + pairs.remote_sub * seg.length
    loc = (lstart[:, None] + seg.local_base[None, :]).reshape(-1)
    rem = (rstart[:, None] + seg.remote_base[None, :]).reshape(-1)
    length = np.full(loc.shape[0], seg.length, dtype=np.int64)
    lo, ro, ln = merge_adjacent(loc, rem, length)
    return RegionRanges(region, name, lo, ro, ln)
