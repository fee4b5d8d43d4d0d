"""The plain-torch twin of the staging kernels: the CPU fallback and the test oracle.

Same signatures and semantics as :mod:`kvxferd.kernels.cuda_ops`; works on any device torch
supports, with ``index_select`` / ``index_copy_`` on the regions' ``uint8`` block views.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvxferd.kernels.geometry import BlockIds, KVPermute, check_call
from kvxferd.kernels.ranges import (
    CheckedCopy,
    GroupCopy,
    RangeCopy,
    RegionsLike,
    check_groups,
    check_ranges,
)


def _permuted(blocks: torch.Tensor, p: KVPermute) -> torch.Tensor:
    """``(n, block_len)`` bytes with every half's A x B items transposed to B x A."""
    n, blen = blocks.shape
    a, b = p.src_dims
    return (
        blocks.reshape(n, blen // p.half_bytes, a, b, p.head_bytes).transpose(2, 3).reshape(n, blen)
    )


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D uint8, unit inner stride) viewed as int64 when every size, stride and the
    address allow it: torch's uint8 ``index_select``/``index_copy_`` on CPU move one byte per
    element (~30 MB/s on 64 KiB rows); as int64 they are ~30x faster. Same bytes either way."""
    if (
        t.device.type == "cpu"
        and t.stride(1) == 1
        and t.shape[1] % 8 == 0
        and t.stride(0) % 8 == 0
        and t.data_ptr() % 8 == 0
    ):
        return t.view(torch.int64)
    return t


def gather_blocks(
    regions: Sequence[torch.Tensor],
    block_ids: BlockIds,
    out: torch.Tensor,
    *,
    permute: KVPermute | None = None,
) -> torch.Tensor:
    """Copy block ``ids[i]`` of every region into staging row ``i`` of ``out``; returns ``out``."""
    c = check_call(regions, block_ids, out, permute, op="gather_blocks", unique=False)
    n = c.ids.numel()
    if n == 0:
        return out
    ids = c.ids.to(out.device)
    rows = out.view(n, c.row_bytes)
    for r, off in zip(regions, c.offsets, strict=True):
        dst = rows[:, off : off + r.shape[1]]
        if permute is None:
            wide_src, wide_dst = _wide(r), _wide(dst)
            if wide_src.dtype == wide_dst.dtype:
                wide_dst.copy_(wide_src.index_select(0, ids))
                continue
        blocks = r.index_select(0, ids)
        if permute is not None:
            blocks = _permuted(blocks, permute)
        dst.copy_(blocks)
    return out


def scatter_blocks(
    regions: Sequence[torch.Tensor],
    block_ids: BlockIds,
    staging: torch.Tensor,
    *,
    permute: KVPermute | None = None,
) -> None:
    """Copy staging row ``i`` into block ``ids[i]`` of every region (IDs must not repeat)."""
    c = check_call(regions, block_ids, staging, permute, op="scatter_blocks", unique=True)
    n = c.ids.numel()
    if n == 0:
        return
    ids = c.ids.to(staging.device)
    rows = staging.view(n, c.row_bytes)
    for r, off in zip(regions, c.offsets, strict=True):
        src = rows[:, off : off + r.shape[1]]
        if permute is not None:
            src = _permuted(src, permute)
            r.index_copy_(0, ids, src)
            continue
        wide_r, wide_src = _wide(r), _wide(src)
        if wide_r.dtype == wide_src.dtype:
            wide_r.index_copy_(0, ids, wide_src)
        else:
            r.index_copy_(0, ids, src)


def copy_ranges(
    dst: RegionsLike,
    src: RegionsLike,
    ranges: RangeCopy,
    *,
    max_ctas: int = 0,
) -> None:
    """Copy every piece of ``ranges`` from ``src`` to ``dst`` (one ``copy_`` per piece;
    ``max_ctas`` is ignored)."""
    d, s = check_ranges(dst, src, ranges)
    for r, a, b, n in zip(
        ranges.region.tolist(),
        ranges.dst_offset.tolist(),
        ranges.src_offset.tolist(),
        ranges.length.tolist(),
        strict=True,
    ):
        d.tensors[r][a : a + n].copy_(s.tensors[r][b : b + n])


def copy_groups(
    dst: RegionsLike, src: RegionsLike, groups: Sequence[GroupCopy], *, max_ctas: int = 0
) -> None:
    """Copy every group's pieces in every region of the group (checked first, all groups)."""
    d, s = check_groups(dst, src, groups)
    for g in groups:
        if g.pieces:
            copy_ranges(d, s, g.flat(), max_ctas=max_ctas)


def run_copy(c: CheckedCopy) -> None:
    """Copy what :func:`~kvxferd.kernels.ranges.check_copy` checked (its tables unused)."""
    if c.ranges is not None:
        copy_ranges(c.dst, c.src, c.ranges)
    else:
        copy_groups(c.dst, c.src, c.groups)
