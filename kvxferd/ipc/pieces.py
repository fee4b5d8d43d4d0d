"""A KERNEL pull's pieces: the plan's ranges coalesced as DIRECT would post them, cut at one
power-of-two size the copy kernel gives every piece a slot of (:func:`piece_size`), and kept
per array that regions share (:class:`~kvxferd.kernels.GroupCopy`: typically every layer
reads the same block runs) so the host never builds the region-by-run product. A fixed number
of NumPy operations per distinct array, no Python loop over pieces or regions.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.ranges import TransferPlan
from kvxferd.kernels import GroupCopy, RangeCopy
from kvxferd.kernels.ranges import lo_hi
from kvxferd.transfer.descriptors import run_groups, split_runs

Int64Array = npt.NDArray[np.int64]

MAX_PIECE_BYTES = 1 << 20
MIN_PIECE_BYTES = 512
# What one more piece costs, in bytes of copy: its table row, its share of the host's NumPy
# work, its row lookups on the GPU (an estimate; it only steers the piece size).
PIECE_COST_BYTES = 16 << 10


def piece_size(
    lengths: Int64Array, largest: int = MAX_PIECE_BYTES, weights: Int64Array | None = None
) -> int:
    """The power-of-two piece size (at most ``largest``) for runs of ``lengths`` bytes (run
    ``i`` counted ``weights[i]`` times, once without ``weights``): the copy kernel gives every
    piece a slot of that size (the part past a short piece's end is skipped), so the size
    minimises slots times (slot + :data:`PIECE_COST_BYTES`). Only the sizes between the
    shortest and the longest run (rounded up) are tried."""
    top = max(MIN_PIECE_BYTES, int(largest)).bit_length() - 1  # largest, rounded down
    if lengths.size == 0:
        return 1 << top
    shortest, longest = lo_hi(lengths)
    lo = min(top, max(MIN_PIECE_BYTES.bit_length() - 1, (shortest - 1).bit_length()))
    hi = min(top, max(lo, (longest - 1).bit_length()))
    if lo == hi:
        return 1 << lo
    ks = np.arange(lo, hi + 1, dtype=np.int64)
    per_run = (lengths[:, None] + (np.int64(1) << ks) - 1) >> ks
    slots = (per_run if weights is None else per_run * weights[:, None]).sum(axis=0)
    cost = slots * ((np.int64(1) << ks) + PIECE_COST_BYTES)
    return 1 << int(ks[int(np.argmin(cost))])


def group_pieces(
    plan: TransferPlan, piece_bytes: int = MAX_PIECE_BYTES
) -> tuple[list[GroupCopy] | RangeCopy, int]:
    """The plan's ranges as kernel pieces, and the number of (region, run) pairs before the
    cut (what DIRECT would post as descriptors): every region's ranges coalesced as DIRECT
    does, the runs cut at one power-of-two size (:func:`piece_size`, at most
    ``piece_bytes``). Regions sharing the planner's arrays (:func:`run_groups`: typically
    every layer) are coalesced, sized and cut once and kept as one :class:`GroupCopy` per
    distinct array, which the kernel repeats over the regions (``copy_group``); when regions
    share too little, one flat :class:`RangeCopy`. A fixed number of NumPy operations per
    distinct array, and no loop over pieces or regions."""
    got = run_groups(plan)
    if isinstance(got, tuple):  # little sharing: every range coalesced at once
        region, lo, ro, ln = got
        if ln.size == 0:
            return RangeCopy.empty(), 0
        return RangeCopy(*split_runs(region, lo, ro, ln, piece_size(ln, piece_bytes))), int(ln.size)
    if not got:
        return [], 0
    runs = sum(g.length.size * g.regions.size for g in got)
    if len(got) == 1:  # one weight for every run: it cannot change the cheapest size
        size = piece_size(got[0].length, piece_bytes)
    else:
        lengths = np.concatenate([g.length for g in got])
        weights = np.concatenate([np.full(g.length.size, g.regions.size) for g in got])
        size = piece_size(lengths, piece_bytes, weights.astype(np.int64))
    out = []
    for g in got:
        zeros = np.zeros(g.length.size, dtype=np.int64)
        _, lo, ro, ln = split_runs(zeros, g.local_offset, g.remote_offset, g.length, size)
        out.append(GroupCopy(g.regions, lo, ro, ln))
    return out, runs


def pieces(plan: TransferPlan, piece_bytes: int = MAX_PIECE_BYTES) -> tuple[RangeCopy, int]:
    """:func:`group_pieces` flattened: one piece per (region, cut run)."""
    got, runs = group_pieces(plan, piece_bytes)
    if isinstance(got, RangeCopy):
        return got, runs
    return RangeCopy.concat([g.flat() for g in got]), runs


def distinct_ranges(plan: TransferPlan) -> int:
    """The plan's ranges with the arrays regions share counted once: the grouped copy's host
    work (:func:`group_pieces`) handles each shared array once."""
    return sum(c.ranges.num_ranges for c in plan.classes)
