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

from kvxferd.blocks.ranges import TransferPlan
from kvxferd.errors import BlockRangeError, InvalidRequest

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


def split_long(
    local_offset: Int64Array, remote_offset: Int64Array, length: Int64Array, max_len: int
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """Cut ranges longer than ``max_len`` into ``max_len`` pieces (the last may be shorter), so
    a multi-threaded UCX backend can spread one huge range over its worker threads."""
    if max_len <= 0:
        raise InvalidRequest(f"max descriptor length must be positive, got {max_len}")
    pieces = (length + max_len - 1) // max_len
    if length.size == 0 or int(pieces.max()) <= 1:
        return local_offset, remote_offset, length
    idx = np.repeat(np.arange(length.size), pieces)
    first = np.cumsum(pieces) - pieces
    k = np.arange(idx.size, dtype=np.int64) - np.repeat(first, pieces)
    skip = k * max_len
    ln = np.minimum(length[idx] - skip, max_len)
    return local_offset[idx] + skip, remote_offset[idx] + skip, ln


def _check_bounds(
    side: str, table: RegionTable, region: int, off: Int64Array, ln: Int64Array
) -> None:
    if not 0 <= region < table.num_regions:
        raise InvalidRequest(
            f"plan names region {region}, the {side} side registered {table.num_regions}",
            field=f"ranges[{region}]",
            fix="re-handshake: the peers' region lists differ",
        )
    if off.size == 0:
        return
    if int(ln.min()) <= 0:
        raise BlockRangeError(
            f"{side} ranges of region {region} include an empty range",
            field=f"ranges[{region}].length",
        )
    end = off + ln
    if int(off.min()) < 0 or int(end.max()) > int(table.length[region]):
        raise BlockRangeError(
            f"{side} ranges of region {region} leave the region "
            f"(0..{int(table.length[region])} bytes)",
            field=f"ranges[{region}]",
            fix="check block IDs against the registered block counts",
        )


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
    contiguous on both sides (within one region: a descriptor never spans registrations);
    ``max_desc_bytes`` then cuts longer ranges (see :func:`split_long`).
    """
    loc_parts: list[Int64Array] = []
    rem_parts: list[Int64Array] = []
    for rr in plan.ranges:
        if rr.num_ranges == 0:
            continue
        lo = rr.local_offset.astype(np.int64, copy=False)
        ro = rr.remote_offset.astype(np.int64, copy=False)
        ln = rr.length.astype(np.int64, copy=False)
        _check_bounds("local", local, rr.region, lo, ln)
        _check_bounds("remote", remote, rr.region, ro, ln)
        if merge:
            lo, ro, ln = coalesce(lo, ro, ln)
        if max_desc_bytes is not None:
            lo, ro, ln = split_long(lo, ro, ln, max_desc_bytes)
        n = ln.shape[0]
        loc = np.empty((n, 3), dtype=np.int64)
        loc[:, 0] = local.base[rr.region] + lo
        loc[:, 1] = ln
        loc[:, 2] = local.dev[rr.region]
        rem = np.empty((n, 3), dtype=np.int64)
        rem[:, 0] = remote.base[rr.region] + ro
        rem[:, 1] = ln
        rem[:, 2] = remote.dev[rr.region]
        loc_parts.append(loc)
        rem_parts.append(rem)
    if not loc_parts:
        empty = np.empty((0, 3), dtype=np.int64)
        return empty, empty.copy()
    return np.concatenate(loc_parts), np.concatenate(rem_parts)
