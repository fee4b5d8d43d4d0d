"""Model-global KV bytes for the TP scenario: what every rank's blocks must hold.

A prefill rank's block and a decode rank's block of the same request hold different slices of
the same model state, so the scenario writes bytes that depend only on *model-global*
coordinates, never on the rank: for an attention region, byte ``b`` of head ``h`` (the
model's head number), token position ``t`` of the request, K or V half ``kv`` and layer
``l``; for an MLA or state region, byte ``b`` of the request's ``k``-th block (state). Any
rank's expected block is then computed from its own head range (``kvxferd/blocks/tp.py``
ownership), independently of how the planner splits the reads: a head, token, layer or block
read from the wrong place, or not read, changes the block's digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvxferd.layout.spec import KVCacheSpec, Region

U8Array = npt.NDArray[np.uint8]
DIGEST_SIZE = 8  # the daemon's Checksum (BLAKE2b-64)

_M = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1, 0x61C88647)


def _mix(seed: int, *coords: npt.NDArray[np.int64]) -> U8Array:
    """One byte per element of the broadcast ``coords``: a hash of (seed, coords...)."""
    with np.errstate(over="ignore"):
        x: npt.NDArray[np.uint32] = np.full(
            (), (seed * 0x9E3779B9 + 0x7F4A7C15) & 0xFFFFFFFF, np.uint32
        )
        for c, m in zip(coords, _M, strict=False):
            x = (x ^ (c.astype(np.uint32) * np.uint32(m))) * np.uint32(0x01000193)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x2C1B3C6D)
        x = x ^ (x >> np.uint32(12))
        x = x * np.uint32(0x297A2D39)
        x = x ^ (x >> np.uint32(15))
    return np.asarray(x & np.uint32(0xFF), dtype=np.uint8)


def _axis(n: int, dim: int, ndim: int, start: int = 0) -> npt.NDArray[np.int64]:
    shape = [1] * ndim
    shape[dim] = n
    return np.arange(start, start + n, dtype=np.int64).reshape(shape)


def region_blocks(
    region: Region,
    index: int,
    positions: Sequence[int],
    first_head: int,
    seed: int,
    *,
    shard: int = 0,
) -> U8Array:
    """The bytes of blocks of ``region`` (region ``index`` of its spec), in memory order,
    shape ``(len(positions), block_len)``.

    ``positions[i]``: which block of the request block ``i`` is (its ``k``: attention and MLA
    blocks hold tokens ``k * tokens_per_block`` on; a state block is the request's ``k``-th
    state). ``first_head``: the model-global number of the rank's first KV head. ``shard``:
    which shard of a state (or MLA) block the rank holds (0 when replicated).
    """
    pos = np.asarray(positions, dtype=np.int64)
    n = int(pos.shape[0])
    lay = region.layout
    if not lay.has_kv_halves:
        nbytes = region.block_len
        key = np.full((n, 1), index * 4096 + shard, np.int64)
        val = _mix(seed, key, pos[:, None], _axis(nbytes, 1, 2))
        return np.ascontiguousarray(val)
    # Logical dims: [layer,] block, kv, token, head, byte (head_size x itemsize bytes).
    cross = lay.is_cross_layer
    ndim = 6
    layers = region.num_layers
    tokens, heads = region.tokens_per_block, region.num_kv_heads
    row = region.head_size * region.dtype.itemsize
    layer = _axis(layers, 0, ndim) + index * 1024
    block_pos = pos.reshape(1, n, 1, 1, 1, 1)
    token = block_pos * tokens + _axis(tokens, 3, ndim)
    val = _mix(
        seed,
        layer,
        _axis(2, 2, ndim),
        token,
        _axis(heads, 4, ndim, first_head),
        _axis(row, 5, ndim),
    )
    full = np.broadcast_to(val, (layers, n, 2, tokens, heads, row))
    if cross:
        order = lay.stride_order(6)
    else:
        full = full[0]
        order = lay.stride_order(5)
    return np.array(full.transpose(order), dtype=np.uint8, order="C").reshape(n, -1)


def group_digests(
    spec: KVCacheSpec,
    group: int,
    positions: Sequence[int],
    first_head: int,
    seed: int,
    *,
    shard: int = 0,
) -> list[bytes]:
    """Per block, the digest the daemon's Checksum gives for a block of ``group`` holding
    request blocks ``positions``: BLAKE2b-64 over the block's bytes in every region of the
    group, in spec order."""
    hashers = [hashlib.blake2b(digest_size=DIGEST_SIZE) for _ in positions]
    for i, r in enumerate(spec.regions):
        if r.group != group:
            continue
        rows = region_blocks(r, i, positions, first_head, seed, shard=shard)
        for h, data in zip(hashers, rows, strict=True):
            h.update(data.tobytes())
    return [h.digest() for h in hashers]
