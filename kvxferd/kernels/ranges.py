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

import contextlib
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import torch

from kvxferd.errors import BlockRangeError, InvalidRequest

Int64Array = npt.NDArray[np.int64]

SMALL = 64
"""Up to this many values, :func:`lo_hi` and :func:`extent` work on Python ints: a NumPy
reduction costs several microseconds for its call alone, more than a pull's few dozen runs
take as a list."""


def lo_hi(a: Int64Array) -> tuple[int, int]:
    """The smallest and largest value of a non-empty 1-D integer array, as Python ints."""
    if a.shape[0] <= SMALL:
        xs = a.tolist()
        return min(xs), max(xs)
    return int(a.min()), int(a.max())


def extent(offset: Int64Array, length: Int64Array) -> tuple[int, int]:
    """``(min(offset), max(offset + length))`` of non-empty, equal-length 1-D integer arrays:
    the lowest byte ranges start at and the byte past the furthest one's end."""
    if offset.shape[0] <= SMALL:
        xs = offset.tolist()
        return min(xs), max(map(operator.add, xs, length.tolist()))
    ends = offset + length
    if bool((ends < offset).any()):  # past 2^63 (int64 wrapped), or a negative length
        return int(offset.min()), max(int(o) + int(n) for o, n in zip(offset, length, strict=True))
    return int(offset.min()), int(ends.max())


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

    @classmethod
    def concat(cls, parts: Sequence[RangeCopy]) -> RangeCopy:
        """The pieces of ``parts``, in order."""
        if not parts:
            return cls.empty()
        return cls(
            *(
                np.concatenate([getattr(p, f) for p in parts])
                for f in ("region", "dst_offset", "src_offset", "length")
            )
        )


@dataclass(frozen=True)
class GroupCopy:
    """Pieces that every region of ``regions`` copies alike: piece ``i`` copies ``length[i]``
    bytes from ``src[r]`` at ``src_offset[i]`` to ``dst[r]`` at ``dst_offset[i]`` for each
    ``r`` in ``regions`` (a per-layer cache's pull: every layer reads the same block runs).
    Flattened, it is the :class:`RangeCopy` of ``regions.size * pieces`` pieces, region by
    region (:meth:`flat`)."""

    regions: Int64Array
    dst_offset: Int64Array
    src_offset: Int64Array
    length: Int64Array

    def __post_init__(self) -> None:
        n = self.length.shape
        if self.regions.ndim != 1 or any(
            a.ndim != 1 or a.shape != n for a in (self.dst_offset, self.src_offset)
        ):
            raise InvalidRequest("group copy arrays must be 1-D, the runs of equal length")

    @property
    def pieces(self) -> int:
        """Pieces once flattened."""
        return int(self.regions.shape[0]) * int(self.length.shape[0])

    def flat(self) -> RangeCopy:
        k, n = int(self.regions.shape[0]), int(self.length.shape[0])
        return RangeCopy(
            np.repeat(self.regions, n),
            np.tile(self.dst_offset, k),
            np.tile(self.src_offset, k),
            np.tile(self.length, k),
        )


@dataclass(frozen=True, eq=False)
class Regions:
    """One side's regions, checked once: the tensors, their base addresses and byte sizes."""

    tensors: tuple[torch.Tensor, ...]
    base: Int64Array
    size: Int64Array
    device: torch.device
    # Facts about read-only region-index arrays (the planner shares one per geometry class
    # between pulls), by id; each entry keeps its array, so the id stays its own.
    facts: dict[int, tuple[Int64Array, int, int, int]] = field(
        default_factory=dict, repr=False, compare=False
    )
    # On a source side: the launch tables' base pairs of such arrays against a destination
    # side (group_table).
    pair_bases: dict[tuple[int, int], tuple[Regions, Int64Array, Int64Array]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def among(self, r: Int64Array) -> tuple[int, int, int]:
        """``(lowest, highest, smallest)`` of the region indices ``r`` (non-empty): the lowest
        and highest index, and the index of the smallest of those regions here (which must
        exist). Worked out once for a read-only ``r``."""
        hit = self.facts.get(id(r))
        if hit is not None and hit[0] is r:
            return hit[1], hit[2], hit[3]
        low, high = int(r.min()), int(r.max())
        small = int(r[int(np.argmin(self.size[r]))]) if low >= 0 and high < len(self) else -1
        if not r.flags.writeable:
            _remember(self.facts, id(r), (r, low, high, small))
        return low, high, small

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
_MAX_FACTS = 64
K = TypeVar("K")
V = TypeVar("V")


def _remember(memo: dict[K, V], key: K, value: V) -> None:
    """Keep ``value`` under ``key`` in a :class:`Regions` memo, the oldest entry dropped once it
    holds :data:`_MAX_FACTS`. The loop and a worker thread may both be here (small pulls run
    inline, big ones in the thread): a drop that lost a race to the other is skipped."""
    if len(memo) >= _MAX_FACTS:
        with contextlib.suppress(KeyError, RuntimeError, StopIteration):
            memo.pop(next(iter(memo)))
    memo[key] = value


def check_ranges(dst: RegionsLike, src: RegionsLike, rc: RangeCopy) -> tuple[Regions, Regions]:
    """Refuse anything outside a region, before any copy runs (typed errors); returns both
    sides as :class:`Regions`."""
    d, s = _pair(dst, src)
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
        # off > size - length, not off + length > size: the sum may wrap past 2^63.
        bad = np.flatnonzero((off < 0) | (off > size[r] - rc.length))
        if bad.size:
            k = int(bad[0])
            end = int(off[k]) + int(rc.length[k])
            raise BlockRangeError(
                f"copy_ranges: piece {k} reads bytes [{int(off[k])}, {end}) of {name}"
                f" region {int(r[k])}, which has {int(size[r[k]])} bytes ({bad.size} piece(s)"
                " outside their region)",
                field=f"ranges[{k}]",
                fix="the peer's regions changed: re-handshake (its generation) and plan again",
            )
    return d, s


def _pair(dst: RegionsLike, src: RegionsLike) -> tuple[Regions, Regions]:
    """Both sides as checked :class:`Regions`: as many of each, on one device."""
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
    return d, s


def check_groups(
    dst: RegionsLike, src: RegionsLike, groups: Sequence[GroupCopy]
) -> tuple[Regions, Regions]:
    """:func:`check_ranges` for :class:`GroupCopy` pieces, without flattening them: every
    region named exists, every length is positive, and each group's furthest byte on each side
    lies within the *smallest* of its regions there, so no run leaves any region it is copied
    in. Refuses exactly what :func:`check_ranges` refuses on the flattened pieces."""
    d, s = _pair(dst, src)
    for k, g in enumerate(groups):
        if not g.pieces:
            continue
        first, last, d_small = d.among(g.regions)
        if first < 0 or last >= len(d):
            raise BlockRangeError(
                f"copy_ranges: group {k} names region {last} of {len(d)}",
                field="ranges",
            )
        if lo_hi(g.length)[0] <= 0:
            raise BlockRangeError(
                f"copy_ranges: a piece of group {k} is empty or negative", field="ranges"
            )
        s_small = s.among(g.regions)[2]
        for name, off, side, small in (
            ("dst", g.dst_offset, d, d_small),
            ("src", g.src_offset, s, s_small),
        ):
            low, end = extent(off, g.length)
            if low < 0 or end > int(side.size[small]):
                raise BlockRangeError(
                    f"copy_ranges: group {k} reads bytes [{low}, {end}) of {name} regions,"
                    f" but {name} region {small} has {int(side.size[small])} bytes",
                    field="ranges",
                    fix="the peer's regions changed: re-handshake (its generation) and plan again",
                )
    return d, s


@dataclass(frozen=True, eq=False)
class CheckedCopy:
    """A copy checked against both sides (:func:`check_ranges` or :func:`check_groups`) with
    its launch tables built when the CUDA kernel will run it (:func:`address_table`, one per
    :class:`GroupCopy` with :func:`group_table`): running it costs the launch and nothing
    else. Valid only while ``dst`` and ``src`` are (whoever holds it keeps the memory the
    source regions view mapped)."""

    dst: Regions
    src: Regions
    ranges: RangeCopy | None  # the flat pieces, or None for groups
    groups: tuple[GroupCopy, ...]
    tables: tuple[torch.Tensor, ...]  # CPU int64, one per launch (none without pieces)
    cuda: bool  # the tables are built: the CUDA kernel runs it, else the twin

    def __post_init__(self) -> None:
        # The group launches hand a table's address to the extension (cuda/bindings.cpp), so
        # every such table is checked here, once, where it is made (off the launch's path).
        if self.cuda and self.ranges is None:
            for t in self.tables:
                if not (
                    t.dtype is torch.int64
                    and t.device.type == "cpu"
                    and t.dim() == 1
                    and t.is_contiguous()
                ):
                    raise InvalidRequest(
                        "copy_group: the table must be a contiguous 1-D int64 CPU tensor"
                    )

    @property
    def pieces(self) -> int:
        if self.ranges is not None:
            return self.ranges.pieces
        return sum(g.pieces for g in self.groups)


def check_copy(
    dst: RegionsLike,
    src: RegionsLike,
    pieces: RangeCopy | Sequence[GroupCopy],
    *,
    tables: bool,
) -> CheckedCopy:
    """Check ``pieces`` (flat, or groups) against both sides, refusing anything outside a
    region before any copy runs, and build the launch tables when ``tables``."""
    if isinstance(pieces, RangeCopy):
        d, s = check_ranges(dst, src, pieces)
        flat: tuple[torch.Tensor, ...] = (
            (address_table(d, s, pieces),) if tables and pieces.pieces else ()
        )
        return CheckedCopy(d, s, pieces, (), flat, tables)
    groups = tuple(g for g in pieces if g.pieces)
    d, s = check_groups(dst, src, groups)
    built = tuple(group_table(d, s, g) for g in groups) if tables else ()
    return CheckedCopy(d, s, None, groups, built, tables)


def group_table(d: Regions, s: Regions, g: GroupCopy) -> torch.Tensor:
    """1-D int64 CPU tensor: ``[dst_offset, src_offset, length]`` per run, then ``[dst_base,
    src_base]`` per region of the group (``cuda/copy_ranges.cu``, copy_group; call after
    :func:`check_groups`). The bases of a read-only regions array (the planner's, shared by
    pulls) are gathered once per pair of sides."""
    n = int(g.length.shape[0])
    bases = _pair_bases(d, s, g.regions)
    out = np.empty(3 * n + bases.shape[0], dtype=np.int64)
    out[0 : 3 * n : 3], out[1 : 3 * n : 3], out[2 : 3 * n : 3] = (
        g.dst_offset,
        g.src_offset,
        g.length,
    )
    out[3 * n :] = bases
    return torch.from_numpy(out)


def _pair_bases(d: Regions, s: Regions, r: Int64Array) -> Int64Array:
    """``[dst_base, src_base]`` of each region of ``r``, interleaved; kept for a read-only
    ``r`` on the *source* side, which goes with its peer's mappings (kept with ``d`` and ``r``,
    so their ids stay theirs; nothing here keeps a source side, and so a mapping, alive)."""
    hit = s.pair_bases.get((id(d), id(r)))
    if hit is not None and hit[0] is d and hit[1] is r:
        return hit[2]
    bases = np.empty(2 * int(r.shape[0]), dtype=np.int64)
    bases[0::2], bases[1::2] = d.base[r], s.base[r]
    if not r.flags.writeable:
        _remember(s.pair_bases, (id(d), id(r)), (d, r, bases))
    return bases


def address_table(dst: RegionsLike, src: RegionsLike, rc: RangeCopy) -> torch.Tensor:
    """``(n, 3)`` int64 CPU tensor ``[dst_addr, src_addr, nbytes]`` (call after
    :func:`check_ranges`)."""
    d, s = Regions.of("dst", dst), Regions.of("src", src)
    out = np.empty((rc.pieces, 3), dtype=np.int64)
    np.add(d.base[rc.region], rc.dst_offset, out=out[:, 0])
    np.add(s.base[rc.region], rc.src_offset, out=out[:, 1])
    out[:, 2] = rc.length
    return torch.from_numpy(out)
