"""Byte-range copies between two sets of regions (KERNEL pulls), checked before anything runs.

A :class:`RangeCopy` is a list of pieces ``(region, dst_offset, src_offset, length)``: piece
``i`` copies ``length[i]`` bytes from ``src[region[i]]`` at ``src_offset[i]`` to
``dst[region[i]]`` at ``dst_offset[i]``. Regions are 1-D contiguous ``uint8`` tensors: on the
reader, its pool's regions (dst) and the owner's regions mapped over CUDA IPC (src), whose
lengths are the *mapped* sizes, so :func:`check_ranges` refuses any piece that would leave a
mapping. Each side can be checked once and kept as :class:`Regions` (base addresses and sizes
as arrays: the reader's pool once, a peer generation's mappings when they are opened), so a
pull's checks and its address table are a few NumPy operations whatever the region count. The
CUDA kernel (``cuda/copy_ranges.cu``) takes absolute addresses (:func:`address_table`); the
twin (:mod:`kvxferd.kernels.twin`) slices tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import numpy.typing as npt
import torch

from kvxferd.errors import BlockRangeError, InvalidRequest

Int64Array = npt.NDArray[np.int64]


class CopyKernel(IntEnum):
    """Which CUDA kernel copies the pieces (``variant`` of ``kvxferd::copy_ranges``)."""

    STRIDE = 0  # grid-stride over the pieces laid end to end (the default)
    CTA_PER_PIECE = 1  # one CTA per piece at a time (the first kernel; kept for the bench)


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


@dataclass(frozen=True, eq=False)
class Regions:
    """One side's regions, checked once: the tensors, their base addresses and byte sizes."""

    tensors: tuple[torch.Tensor, ...]
    base: Int64Array
    size: Int64Array
    device: torch.device

    def __len__(self) -> int:
        return len(self.tensors)

    @classmethod
    def of(cls, what: str, regions: Sequence[torch.Tensor] | Regions) -> Regions:
        """Check ``regions`` (1-D contiguous uint8, one device); ``what`` names the side in
        errors (``"dst"`` or ``"src"``). A :class:`Regions` is returned as it is."""
        if isinstance(regions, Regions):
            return regions
        ts = tuple(regions)
        device = ts[0].device if ts else torch.device("cpu")
        for i, t in enumerate(ts):
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
        base = np.array([t.data_ptr() for t in ts], dtype=np.int64)
        size = np.array([t.numel() for t in ts], dtype=np.int64)
        return cls(ts, base, size, device)


RegionsLike = Sequence[torch.Tensor] | Regions


def check_ranges(dst: RegionsLike, src: RegionsLike, rc: RangeCopy) -> tuple[Regions, Regions]:
    """Refuse anything outside a region, before any copy runs (typed errors); returns both
    sides as :class:`Regions`."""
    d, s = Regions.of("dst", dst), Regions.of("src", src)
    if len(d) != len(s) or not len(d):
        raise InvalidRequest(
            f"copy_ranges: {len(d)} destination and {len(s)} source regions",
            field="regions",
            fix="pass one source region per destination region, in region order",
        )
    if s.device != d.device:
        raise InvalidRequest(
            f"copy_ranges: the source regions are on {s.device}, the destination on {d.device}",
            field="src[0]",
            fix="map or allocate every region on the device that runs the copy",
        )
    if rc.pieces == 0:
        return d, s
    r = rc.region
    if int(r.min()) < 0 or int(r.max()) >= len(d):
        raise BlockRangeError(
            f"copy_ranges: a piece names region {int(r.max())} of {len(d)}", field="ranges"
        )
    if int(rc.length.min()) <= 0:
        raise BlockRangeError("copy_ranges: a piece is empty or negative", field="ranges")
    for name, off, size in (("dst", rc.dst_offset, d.size), ("src", rc.src_offset, s.size)):
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
    return d, s


def address_table(dst: RegionsLike, src: RegionsLike, rc: RangeCopy) -> torch.Tensor:
    """``(n, 3)`` int64 CPU tensor ``[dst_addr, src_addr, nbytes]`` (call after
    :func:`check_ranges`)."""
    d, s = Regions.of("dst", dst), Regions.of("src", src)
    out = np.empty((rc.pieces, 3), dtype=np.int64)
    np.add(d.base[rc.region], rc.dst_offset, out=out[:, 0])
    np.add(s.base[rc.region], rc.src_offset, out=out[:, 1])
    out[:, 2] = rc.length
    return torch.from_numpy(out)
