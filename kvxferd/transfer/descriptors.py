"""Descriptors from a plan: region bases + plan offsets, vectorised, coalesced (pure).

A :class:`~kvxferd.blocks.ranges.TransferPlan` gives byte offsets per region pair. Adding each
side's region base turns them into NIXL's ``N x 3`` ``(addr, len, dev)`` rows with a handful of
NumPy operations, whatever the number of blocks: no per-block Python objects. Ranges that are
contiguous on *both* sides are merged first, so a plan of contiguous blocks posts one descriptor
per region however it was expanded. Nothing here imports NIXL.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.ranges import RegionRanges, SharedRanges, TransferPlan
from kvxferd.errors import BlockRangeError, InvalidRequest
from kvxferd.kernels.ranges import extent, lo_hi

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True)
class RegionTable:
    """One side's registered regions by region index: base address, length, device."""

    base: Int64Array
    length: Int64Array
    dev: Int64Array

    def __post_init__(self) -> None:
        n = self.base.shape[0]
        if self.base.shape != (n,) or self.length.shape != (n,) or self.dev.shape != (n,):
            raise InvalidRequest("region base, length and dev must be 1-D of equal length")

    @classmethod
    def from_array(cls, regions: npt.ArrayLike) -> RegionTable:
        """From an ``N x 3`` ``(addr, len, dev)`` array (what a handshake carries)."""
        arr = np.asarray(regions, dtype=np.int64)
        if arr.ndim != 2 or arr.shape[1] != 3:
            raise InvalidRequest(
                f"regions must be N x 3 (addr, len, dev), got {arr.shape}", field="regions"
            )
        if arr.shape[0] and (arr[:, 0].min() <= 0 or arr[:, 1].min() <= 0):
            raise InvalidRequest("region addresses and lengths must be positive", field="regions")
        return cls(arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy())

    def as_array(self) -> Int64Array:
        return np.stack([self.base, self.length, self.dev], axis=1)

    @property
    def num_regions(self) -> int:
        return int(self.base.shape[0])


def coalesce(
    local_offset: Int64Array, remote_offset: Int64Array, length: Int64Array
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """Merge ranges that are back to back on both sides; returns sorted, merged arrays.

    Ranges are sorted by local offset first, so runs are found whatever order the plan lists
    them in. Every byte is kept exactly once (the total length is unchanged).
    """
    n = int(length.shape[0])
    if n <= 1:
        return local_offset.copy(), remote_offset.copy(), length.copy()
    order = np.argsort(local_offset, kind="stable")
    lo, ro, ln = local_offset[order], remote_offset[order], length[order]
    joins = (lo[:-1] + ln[:-1] == lo[1:]) & (ro[:-1] + ln[:-1] == ro[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return lo[starts], ro[starts], np.add.reduceat(ln, starts)


Runs = tuple[Int64Array, Int64Array, Int64Array, Int64Array]
"""Flat ``(region, local_offset, remote_offset, length)`` arrays, one row per range."""


def split_runs(
    region: Int64Array,
    local_offset: Int64Array,
    remote_offset: Int64Array,
    length: Int64Array,
    max_len: int,
) -> Runs:
    """Cut ranges longer than ``max_len`` into ``max_len`` pieces (the last may be shorter),
    keeping each piece's region: a multi-threaded UCX backend spreads one huge range over its
    worker threads, and the copy kernel gives every piece one slot."""
    if max_len <= 0:
        raise InvalidRequest(f"max descriptor length must be positive, got {max_len}")
    if length.size == 0 or lo_hi(length)[1] <= max_len:  # every range is one piece
        return region, local_offset, remote_offset, length
    pieces = (length + max_len - 1) // max_len
    idx = np.repeat(np.arange(length.size), pieces)
    first = np.cumsum(pieces) - pieces
    skip = (np.arange(idx.size, dtype=np.int64) - np.repeat(first, pieces)) * max_len
    ln = np.minimum(length[idx] - skip, max_len)
    return region[idx], local_offset[idx] + skip, remote_offset[idx] + skip, ln


def _int64(a: npt.NDArray[np.integer]) -> Int64Array:
    return a.astype(np.int64, copy=False)


def _merge_all(region: Int64Array, lo: Int64Array, ro: Int64Array, ln: Int64Array) -> Runs:
    """:func:`coalesce` for the ranges of many regions at once (one sort by region, then local
    offset; a run never crosses from one region into the next)."""
    if ln.size <= 1:
        return region, lo, ro, ln
    order = np.lexsort((lo, region))
    region, lo, ro, ln = region[order], lo[order], ro[order], ln[order]
    joins = (region[:-1] == region[1:]) & (lo[:-1] + ln[:-1] == lo[1:])
    joins &= ro[:-1] + ln[:-1] == ro[1:]
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    if starts.size == ln.size:
        return region, lo, ro, ln
    return region[starts], lo[starts], ro[starts], np.add.reduceat(ln, starts)


@dataclass(frozen=True)
class RunGroup:
    """Coalesced runs that every region of ``regions`` reads (the planner gave those regions
    the same arrays)."""

    regions: Int64Array
    local_offset: Int64Array
    remote_offset: Int64Array
    length: Int64Array

    def flat(self) -> Runs:
        """One row per (region, run): the regions in order, each with every run."""
        k = int(self.regions.size)
        return (
            np.repeat(self.regions, self.length.size),
            np.tile(self.local_offset, k),
            np.tile(self.remote_offset, k),
            np.tile(self.length, k),
        )


def _classes(plan: TransferPlan) -> tuple[SharedRanges, ...]:
    """The plan's non-empty regions grouped by the arrays they share; raises
    :class:`BlockRangeError` for an empty or negative range."""
    classes = plan.classes
    for c in classes:
        if lo_hi(c.ranges.length)[0] <= 0:
            r = c.ranges.region
            raise BlockRangeError(
                f"the ranges of region {r} include an empty or negative range",
                field=f"ranges[{r}].length",
            )
    return classes


def _nonempty(plan: TransferPlan) -> list[RegionRanges]:
    """The plan's regions that read something, each with its own ranges."""
    return [rr for rr in plan.ranges if rr.length.shape[0]]


def run_groups(plan: TransferPlan) -> list[RunGroup] | Runs:
    """The plan's runs, each distinct array coalesced once, as :class:`RunGroup` s; or, when
    the regions share too little for that to pay, every range coalesced in one sort as flat
    :data:`Runs`. Raises :class:`BlockRangeError` for an empty or negative range."""
    classes = _classes(plan)
    if 4 * len(classes) > sum(int(c.regions.shape[0]) for c in classes):
        return _one_sort(_nonempty(plan), merge=True)
    out = []
    for c in classes:
        one = c.ranges
        if one.coalesced:  # the planner's whole-block runs: already what coalesce returns
            lo, ro, ln = one.local_offset, one.remote_offset, one.length
        else:
            lo, ro, ln = coalesce(
                _int64(one.local_offset), _int64(one.remote_offset), _int64(one.length)
            )
        out.append(RunGroup(c.regions, lo, ro, ln))
    return out


def flatten(groups: list[RunGroup]) -> Runs:
    """The groups' rows as flat :data:`Runs`, group after group."""
    if len(groups) == 1:
        return groups[0].flat()
    if not groups:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty, empty
    flat = [g.flat() for g in groups]
    region, lo, ro, ln = (np.concatenate([f[i] for f in flat]) for i in range(4))
    return region, lo, ro, ln


def _one_sort(parts: list[RegionRanges], *, merge: bool) -> Runs:
    """Every range of ``parts`` flat, in plan order; with ``merge``, coalesced in one sort."""
    if not parts:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty, empty
    counts = [rr.num_ranges for rr in parts]
    region = np.repeat(np.array([rr.region for rr in parts], dtype=np.int64), counts)
    lo, ro, ln = (
        _int64(np.concatenate([getattr(rr, f) for rr in parts]))
        for f in ("local_offset", "remote_offset", "length")
    )
    return _merge_all(region, lo, ro, ln) if merge else (region, lo, ro, ln)


def plan_runs(plan: TransferPlan, *, merge: bool = True) -> Runs:
    """Every range of ``plan`` as flat ``(region, local_offset, remote_offset, length)``
    arrays; with ``merge``, ranges back to back on both sides within one region are merged
    (:func:`coalesce`; a run never spans two regions, since each is its own registration).

    The planner gives regions of one geometry (typically every layer) the *same* arrays:
    those are checked and coalesced once and repeated over their regions
    (:func:`run_groups`), so a 32-layer pull costs about one layer's NumPy calls; with little
    sharing, everything is coalesced in one sort. Either way a fixed number of NumPy
    operations per distinct array, none per range. Raises :class:`BlockRangeError` for an
    empty or negative range.
    """
    if not merge:
        _classes(plan)  # the ranges' check
        return _one_sort(_nonempty(plan), merge=False)
    runs = run_groups(plan)
    return runs if isinstance(runs, tuple) else flatten(runs)


def _check_bounds(
    side: str, table: RegionTable, region: Int64Array, off: Int64Array, ln: Int64Array
) -> None:
    """Every range inside its region of ``table`` (one vectorised test for all of them)."""
    if region.size == 0:
        return
    lo_r, hi_r = int(region.min()), int(region.max())
    if lo_r < 0 or hi_r >= table.num_regions:
        bad = lo_r if lo_r < 0 else hi_r
        raise InvalidRequest(
            f"plan names region {bad}, the {side} side registered {table.num_regions}",
            field=f"ranges[{bad}]",
            fix="re-handshake: the peers' region lists differ",
        )
    size = table.length[region]
    # off > size - ln, not off + ln > size: the sum may wrap past 2^63.
    outside = np.flatnonzero((off < 0) | (off > size - ln))
    if outside.size:
        k = int(outside[0])
        r = int(region[k])
        raise BlockRangeError(
            f"{side} ranges of region {r} leave the region (0..{int(table.length[r])} bytes):"
            f" one covers bytes [{int(off[k])}, {int(off[k]) + int(ln[k])})",
            field=f"ranges[{r}]",
            fix="check block IDs against the registered block counts",
        )


def _group_fits(table: RegionTable, g: RunGroup, offset: Int64Array) -> bool:
    """Whether every run of ``g`` lies inside every region of ``g`` on ``table``'s side: each
    region reads every run, so the runs' extent against the group's smallest region decides."""
    lo_r, hi_r = lo_hi(g.regions)
    if lo_r < 0 or hi_r >= table.num_regions:
        return False
    start, end = extent(offset, g.length)
    return start >= 0 and end <= lo_hi(table.length[g.regions])[0]


def _group_rows(table: RegionTable, g: RunGroup, offset: Int64Array) -> Int64Array:
    """``g``'s descriptors on ``table``'s side: its regions in order, each with every run."""
    k, m = int(g.regions.size), int(g.length.size)
    out = np.empty((k, m, 3), dtype=np.int64)
    np.add(table.base[g.regions][:, None], offset, out=out[:, :, 0])
    out[:, :, 1] = g.length
    out[:, :, 2] = table.dev[g.regions][:, None]
    return out.reshape(k * m, 3)


def _grouped(
    groups: list[RunGroup], local: RegionTable, remote: RegionTable
) -> tuple[Int64Array, Int64Array]:
    """:func:`build_descriptors` of runs shared by regions, every group known to fit both
    sides (:func:`_group_fits`): each group's rows built by broadcasting."""
    loc = [_group_rows(local, g, g.local_offset) for g in groups]
    rem = [_group_rows(remote, g, g.remote_offset) for g in groups]
    if len(groups) == 1:
        return loc[0], rem[0]
    return np.concatenate(loc), np.concatenate(rem)


def build_descriptors(
    plan: TransferPlan,
    local: RegionTable,
    remote: RegionTable,
    *,
    merge: bool = True,
    max_desc_bytes: int | None = None,
) -> tuple[Int64Array, Int64Array]:
    """``(local, remote)`` ``N x 3`` int64 descriptor arrays for ``plan``, rows paired.

    Bounds are checked against both sides' region lengths; ``merge`` coalesces ranges
    contiguous on both sides (within one region: a descriptor never spans registrations;
    :func:`plan_runs`); ``max_desc_bytes`` then cuts longer ranges (:func:`split_runs`).
    Proportional to the plan's distinct arrays and ranges, not to the regions.
    """
    if merge and max_desc_bytes is None:
        runs = run_groups(plan)
        if not isinstance(runs, tuple):
            # Runs shared by regions: each group checked once against its smallest region on
            # each side. A group that does not fit goes the flat way below, whose check of
            # every row gives the refusal.
            if runs and all(
                _group_fits(local, g, g.local_offset) and _group_fits(remote, g, g.remote_offset)
                for g in runs
            ):
                return _grouped(runs, local, remote)
            runs = flatten(runs)
        region, lo, ro, ln = runs
    else:
        region, lo, ro, ln = plan_runs(plan, merge=merge)
    _check_bounds("local", local, region, lo, ln)
    _check_bounds("remote", remote, region, ro, ln)
    if max_desc_bytes is not None:
        region, lo, ro, ln = split_runs(region, lo, ro, ln, max_desc_bytes)
    n = ln.shape[0]
    loc = np.empty((n, 3), dtype=np.int64)
    np.add(local.base[region], lo, out=loc[:, 0])
    loc[:, 1] = ln
    loc[:, 2] = local.dev[region]
    rem = np.empty((n, 3), dtype=np.int64)
    np.add(remote.base[region], ro, out=rem[:, 0])
    rem[:, 1] = ln
    rem[:, 2] = remote.dev[region]
    return loc, rem
