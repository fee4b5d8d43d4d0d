"""Byte-range copies between two sets of regions (KERNEL pulls), checked before anything runs.

A :class:`RangeCopy` is a list of pieces ``(region, dst_offset, src_offset, length)``: piece
``i`` copies ``length[i]`` bytes from ``src[region[i]]`` at ``src_offset[i]`` to
``dst[region[i]]`` at ``dst_offset[i]``. Regions are 1-D contiguous ``uint8`` tensors: on the
reader, its pool's regions (dst) and the owner's regions mapped over CUDA IPC (src), whose
lengths are the *mapped* sizes, so :func:`check_ranges` refuses any piece that would leave a
mapping. The CUDA kernel (``cuda/copy_ranges.cu``) takes absolute addresses
(:func:`address_table`); the twin (:mod:`kvxferd.kernels.twin`) slices tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvxferd.errors import BlockRangeError, InvalidRequest

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True)
class RangeCopy:
    """Pieces to copy, as four int64 arrays of equal length."""

    region: Int64Array
    dst_offset: Int64Array
    src_offset: Int64Array
    length: Int64Array

    def __post_init__(self) -> None:
        n = self.region.shape
        others = (self.dst_offset, self.src_offset, self.length)
        if self.region.ndim != 1 or any(a.shape != n for a in others):
            raise InvalidRequest("range copy arrays must be 1-D of equal length", field="ranges")

    @property
    def pieces(self) -> int:
        return int(self.length.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.length.sum()) if self.pieces else 0

    @classmethod
    def empty(cls) -> RangeCopy:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z, z)


def _check_side(what: str, regions: Sequence[torch.Tensor], device: torch.device) -> Int64Array:
    sizes = np.zeros(len(regions), dtype=np.int64)
    for i, t in enumerate(regions):
        if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
            raise InvalidRequest(
                f"copy_ranges: {what}[{i}] must be a 1-D contiguous uint8 tensor, got"
                f" {t.dtype} {list(t.shape)}",
                field=f"{what}[{i}]",
            )
        if t.device != device:
            raise InvalidRequest(
                f"copy_ranges: {what}[{i}] is on {t.device}, {what}[0] on {device}",
                field=f"{what}[{i}]",
                fix="map or allocate every region on the device that runs the copy",
            )
        sizes[i] = t.numel()
    return sizes


def check_ranges(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], rc: RangeCopy) -> None:
    """Refuse anything outside a region, before any copy runs (typed errors)."""
    if len(dst) != len(src) or not dst:
        raise InvalidRequest(
            f"copy_ranges: {len(dst)} destination and {len(src)} source regions",
            field="regions",
            fix="pass one source region per destination region, in region order",
        )
    device = dst[0].device
    dsize = _check_side("dst", dst, device)
    ssize = _check_side("src", src, device)
    if rc.pieces == 0:
        return
    r = rc.region
    if int(r.min()) < 0 or int(r.max()) >= len(dst):
        raise BlockRangeError(
            f"copy_ranges: a piece names region {int(r.max())} of {len(dst)}", field="ranges"
        )
    if int(rc.length.min()) <= 0:
        raise BlockRangeError("copy_ranges: a piece is empty or negative", field="ranges")
    for name, off, size in (("dst", rc.dst_offset, dsize), ("src", rc.src_offset, ssize)):
        end = off + rc.length
        bad = np.flatnonzero((off < 0) | (end > size[r]))
        if bad.size:
            k = int(bad[0])
            raise BlockRangeError(
                f"copy_ranges: piece {k} reads bytes [{int(off[k])}, {int(end[k])}) of {name}"
                f" region {int(r[k])}, which has {int(size[r[k]])} bytes ({bad.size} piece(s)"
                " outside their region)",
                field=f"ranges[{k}]",
                fix="the peer's regions changed: re-handshake (its generation) and plan again",
            )


def address_table(
    dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], rc: RangeCopy
) -> torch.Tensor:
    """``(n, 3)`` int64 CPU tensor ``[dst_addr, src_addr, nbytes]`` (call after
    :func:`check_ranges`)."""
    dbase = np.array([t.data_ptr() for t in dst], dtype=np.int64)
    sbase = np.array([t.data_ptr() for t in src], dtype=np.int64)
    out = np.empty((rc.pieces, 3), dtype=np.int64)
    out[:, 0] = dbase[rc.region] + rc.dst_offset
    out[:, 1] = sbase[rc.region] + rc.src_offset
    out[:, 2] = rc.length
    return torch.from_numpy(out)
