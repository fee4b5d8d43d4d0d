"""Paired kernel block IDs + per-block segments -> byte ranges, merged where memory allows.

Two consecutive pairs ``(l, r)`` and ``(l+1, r+1)`` merge into one range when the segment is
the whole block and both regions are dense (``stride == block_len``): only then does block
``l``'s last byte touch block ``l+1``'s first on both sides. Pairs are sorted by local ID
(stable) first, to maximise merging.

Cost: :func:`find_runs` is computed once per group (``O(blocks)``, vectorised); each region
then scales the runs by its own stride and length (:func:`region_ranges`, ``O(runs)`` NumPy
for mergeable regions, ``O(blocks x segments)`` otherwise). No Python loop over blocks, except
over a short list (:data:`SMALL_PAIRS`), where a loop costs less than the NumPy calls.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.ranges import Int64Array, RegionRanges
from kvxferd.blocks.tp import RankSegments
from kvxferd.layout.spec import Region


@dataclass(frozen=True)
class Runs:
    """Paired kernel IDs sorted by local ID, and their maximal runs of consecutive pairs.

    ``local_ids``/``remote_ids``: shape ``(n,)``, pair ``i`` is ``(local_ids[i],
    remote_ids[i])``. ``local_start``/``remote_start``/``length``: shape ``(runs,)``; run ``j``
    is the pairs ``(local_start[j] + t, remote_start[j] + t)`` for ``t < length[j]``.
    """

    local_ids: Int64Array
    remote_ids: Int64Array
    local_start: Int64Array
    remote_start: Int64Array
    length: Int64Array

    @property
    def num_blocks(self) -> int:
        return int(self.local_ids.shape[0])

    @property
    def num_runs(self) -> int:
        return int(self.length.shape[0])


def _sort_order(ids: Int64Array) -> Int64Array:
    """Stable ascending order of ``ids``: a counting scatter (``O(n + max)``) when the IDs are
    non-negative, unique and dense enough, else a stable argsort."""
    n = ids.shape[0]
    lo, hi = int(ids.min()), int(ids.max())
    if lo >= 0 and hi < 4 * n + 4096:
        pos = np.full(hi + 1, -1, dtype=np.int64)
        pos[ids] = np.arange(n, dtype=np.int64)
        order = pos[pos >= 0]
        if order.shape[0] == n:  # unique: nothing was overwritten
            return order
    return np.argsort(ids, kind="stable")


SMALL_PAIRS = 64
"""Up to this many pairs, :func:`find_runs` works on Python ints (:func:`_small_runs`): for a
pull's usual few dozen blocks, the twenty NumPy calls of the vectorised form cost more."""


def _small_runs(loc: Int64Array, rem: Int64Array) -> Runs:
    """:func:`find_runs` of a short, non-empty pair list, on Python ints: the same stable sort by
    local ID and the same runs, found in one pass (tests/blocks check both forms agree)."""
    lv, rv = loc.tolist(), rem.tolist()
    if any(b <= a for a, b in itertools.pairwise(lv)):
        pairs = sorted(zip(lv, rv, strict=True), key=_first)  # stable, as _sort_order
        lv, rv = [p[0] for p in pairs], [p[1] for p in pairs]
        loc, rem = np.array(lv, dtype=np.int64), np.array(rv, dtype=np.int64)
    pl, pr = lv[0], rv[0]
    starts_l, starts_r, lengths = [pl], [pr], []
    k = 1
    for a, b in zip(lv[1:], rv[1:], strict=True):
        if a - pl == 1 and b - pr == 1:
            k += 1
        else:
            lengths.append(k)
            starts_l.append(a)
            starts_r.append(b)
            k = 1
        pl, pr = a, b
    lengths.append(k)
    return Runs(
        loc,
        rem,
        np.array(starts_l, dtype=np.int64),
        np.array(starts_r, dtype=np.int64),
        np.array(lengths, dtype=np.int64),
    )


_first = operator.itemgetter(0)


def find_runs(local_ids: npt.ArrayLike, remote_ids: npt.ArrayLike) -> Runs:
    """Sort pairs by local ID (stable) and find runs where both sides advance by exactly 1.

    ``local_ids``, ``remote_ids``: equal-length 1-D integer arrays of paired kernel IDs.
    """
    loc = np.asarray(local_ids, dtype=np.int64).reshape(-1)
    rem = np.asarray(remote_ids, dtype=np.int64).reshape(-1)
    if loc.shape != rem.shape:
        raise ValueError(f"paired ID arrays differ in length: {loc.shape[0]} vs {rem.shape[0]}")
    n = loc.shape[0]
    if 0 < n <= SMALL_PAIRS:
        return _small_runs(loc, rem)
    if n > 1 and not bool((loc[1:] > loc[:-1]).all()):
        order = _sort_order(loc)
        loc, rem = loc[order], rem[order]
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Runs(loc, rem, empty, empty.copy(), empty.copy())
    brk = np.flatnonzero((np.diff(loc) != 1) | (np.diff(rem) != 1)) + 1
    starts = np.concatenate((np.zeros(1, dtype=np.int64), brk))
    ends = np.concatenate((brk, np.array([n], dtype=np.int64)))
    lengths = ends - starts
    return Runs(loc, rem, loc[starts], rem[starts], lengths)


def mergeable(local: Region, remote: Region, seg: RankSegments) -> bool:
    """Whether consecutive paired blocks of this region pair are contiguous on both sides."""
    return (
        seg.whole_block
        and local.block_len == remote.block_len
        and local.stride == local.block_len
        and remote.stride == remote.block_len
    )


def region_ranges(
    runs: Runs,
    *,
    region: int,
    name: str,
    local_stride: int,
    remote_stride: int,
    seg: RankSegments,
    merge: bool,
) -> RegionRanges:
    """Byte ranges of one region pair for one remote rank.

    ``merge=True`` (see :func:`mergeable`): one range per run, ``length = run_len *
    seg.length[0]``, marked ``coalesced`` (:func:`find_runs` sorted the runs by local ID and
    made them maximal, so no two are back to back on both sides). Otherwise one range per
    (pair, segment), ordered by local block then segment: ``local = l*local_stride +
    seg.local_offset[s]`` and likewise remote.
    """
    if merge:
        return RegionRanges(
            region,
            name,
            runs.local_start * local_stride,
            runs.remote_start * remote_stride,
            runs.length * int(seg.length[0]),
            coalesced=True,
        )
    loc = (runs.local_ids * local_stride)[:, None] + seg.local_offset[None, :]
    rem = (runs.remote_ids * remote_stride)[:, None] + seg.remote_offset[None, :]
    length = np.broadcast_to(seg.length[None, :], loc.shape)
    return RegionRanges(
        region, name, loc.reshape(-1), rem.reshape(-1), np.ascontiguousarray(length).reshape(-1)
    )


def coalesce(
    local_ids: npt.ArrayLike,
    remote_ids: npt.ArrayLike,
    local: Region,
    remote: Region,
    seg: RankSegments,
    *,
    region: int = 0,
) -> RegionRanges:
    """One-shot form: paired kernel IDs of one region pair + its segments -> ``RegionRanges``.

    :func:`kvxferd.blocks.plan.plan_pull` uses :func:`find_runs` once per group and
    :func:`region_ranges` per region instead.
    """
    return region_ranges(
        find_runs(local_ids, remote_ids),
        region=region,
        name=local.name,
        local_stride=local.stride,
        remote_stride=remote.stride,
        seg=seg,
        merge=mergeable(local, remote, seg),
    )
