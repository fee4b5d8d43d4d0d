"""The output of planning: byte ranges to move, per region, as NumPy arrays.

A plan never holds per-descriptor Python objects: each region's ranges are three parallel
``int64`` arrays, so building descriptors from a plan is one vectorised add of base addresses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np
import numpy.typing as npt

Int64Array = npt.NDArray[np.int64]


class Named(Protocol):
    """What a plan reads of a region it lists (:class:`kvxferd.layout.spec.Region`)."""

    @property
    def name(self) -> str: ...


@dataclass(frozen=True)
class RegionRanges:
    """Byte ranges for one region pair (regions pair by index: same name, same order).

    ``local_offset[i]`` / ``remote_offset[i]`` are byte offsets from each side's region base,
    ``length[i]`` the bytes of range ``i``. Ranges never cross a region's end. ``coalesced``:
    the maker guarantees the ranges are sorted by local offset, unique, and that no range
    continues the previous one on both sides (what ``transfer.descriptors.coalesce`` would
    return), so that coalescing them again is skipped; the planner's whole-block runs are.
    """

    region: int
    name: str
    local_offset: Int64Array
    remote_offset: Int64Array
    length: Int64Array
    coalesced: bool = False

    def __post_init__(self) -> None:
        n = self.length.shape[0]
        if self.local_offset.shape != (n,) or self.remote_offset.shape != (n,):
            raise ValueError("local_offset, remote_offset and length must be 1-D of equal length")

    @classmethod
    def sharing(cls, region: int, name: str, like: RegionRanges) -> RegionRanges:
        """Region ``region``'s ranges over the very arrays of ``like`` (a region of the same
        geometry): built without the shape check ``like`` already passed. The planner makes
        one per layer, so a small pull's plan is not dominated by 32 identical checks."""
        rr = object.__new__(cls)
        rr.__dict__.update(
            region=region,
            name=name,
            local_offset=like.local_offset,
            remote_offset=like.remote_offset,
            length=like.length,
            coalesced=like.coalesced,
        )
        return rr

    @property
    def num_ranges(self) -> int:
        return int(self.length.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())


@dataclass(frozen=True, eq=False)
class SharedRanges:
    """Regions that read the very same range arrays (the planner gives every region of one
    geometry class, typically every layer, the same arrays): ``regions`` lists them in region
    order (read-only ``int64``), ``ranges`` is the first one's."""

    regions: Int64Array
    ranges: RegionRanges

    @property
    def nbytes(self) -> int:
        return self.ranges.nbytes * int(self.regions.shape[0])

    @property
    def num_ranges(self) -> int:
        return self.ranges.num_ranges * int(self.regions.shape[0])


class TransferPlan:
    """Everything a pull moves: byte ranges per region plus the local kernel blocks written.

    ``ranges[i]``: region ``i``'s ranges (empty when the plan reads nothing of it).
    ``local_kernel_blocks[g]`` lists, per KV group ``g``, the local kernel block IDs the plan
    writes (the blocks that become invalid if the transfer fails). ``naive_descriptors`` is how
    many descriptors one-per-(region, kernel block) would have taken, for telemetry.

    Immutable. A plan is made from its ranges, or by the planner from its :attr:`classes`
    (:meth:`of_classes`), in which case the per-region ``ranges`` are built only if something
    asks for them: the hot paths (sizes, the KERNEL pieces, DIRECT's coalescing) work per class,
    so a small pull of a 32-layer model does not build 32 objects.
    """

    local_kernel_blocks: tuple[Int64Array, ...]
    naive_descriptors: int

    def __init__(
        self,
        ranges: tuple[RegionRanges, ...] = (),
        local_kernel_blocks: tuple[Int64Array, ...] = (),
        naive_descriptors: int = 0,
    ) -> None:
        d = self.__dict__
        d["ranges"] = tuple(ranges)
        d["local_kernel_blocks"] = local_kernel_blocks
        d["naive_descriptors"] = naive_descriptors

    @classmethod
    def of_classes(
        cls,
        regions: Sequence[Named],
        classes: tuple[SharedRanges, ...],
        local_kernel_blocks: tuple[Int64Array, ...],
        naive_descriptors: int,
    ) -> TransferPlan:
        """The planner's plan: of ``regions`` (every region of the pool, in order, as the
        spec lists them; only their names are read), each class's read its ranges (classes
        in the order of their first region, non-empty ranges only); every other region reads
        nothing."""
        plan = object.__new__(cls)
        d = plan.__dict__
        d["_regions"] = regions
        d["classes"] = classes
        d["local_kernel_blocks"] = local_kernel_blocks
        d["naive_descriptors"] = naive_descriptors
        return plan

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"TransferPlan is immutable (tried to set {name!r})")

    def __repr__(self) -> str:
        return (
            f"TransferPlan({self.num_ranges} ranges, {self.nbytes} bytes,"
            f" {len(self.classes)} classes, naive_descriptors={self.naive_descriptors})"
        )

    @cached_property
    def ranges(self) -> tuple[RegionRanges, ...]:
        regions: Sequence[Named] = self.__dict__["_regions"]
        slots: list[RegionRanges | None] = [None] * len(regions)
        for c in self.classes:
            first = c.ranges
            for i in c.regions.tolist():
                slots[i] = (
                    first if i == first.region else RegionRanges.sharing(i, regions[i].name, first)
                )
        empty = _EMPTY
        return tuple(
            rr if rr is not None else RegionRanges(i, regions[i].name, empty, empty, empty)
            for i, rr in enumerate(slots)
        )

    @cached_property
    def classes(self) -> tuple[SharedRanges, ...]:
        """The non-empty regions grouped by the arrays they share, each group in region order
        and the groups in the order of their first region: the planner's, or found once by
        identity (:attr:`shared`) for a plan made from its ranges."""
        return tuple(
            SharedRanges(frozen(np.array([rr.region for rr in g], dtype=np.int64)), g[0])
            for g in self.shared
        )

    @cached_property
    def shared(self) -> tuple[tuple[RegionRanges, ...], ...]:
        """:attr:`classes` with each member's own :class:`RegionRanges`."""
        if "_regions" in self.__dict__:  # the planner's: ranges[i] is region i
            ranges = self.ranges
            return tuple(tuple(ranges[i] for i in c.regions.tolist()) for c in self.classes)
        groups: dict[tuple[int, int, int], list[RegionRanges]] = {}
        for rr in self.ranges:
            if rr.length.shape[0]:
                key = (id(rr.local_offset), id(rr.remote_offset), id(rr.length))
                members = groups.get(key)
                if members is None:
                    groups[key] = [rr]
                else:
                    members.append(rr)
        return tuple(tuple(m) for m in groups.values())

    @cached_property
    def num_ranges(self) -> int:
        return sum(c.num_ranges for c in self.classes)

    @cached_property
    def nbytes(self) -> int:
        # Regions sharing the planner's arrays: each distinct array summed once.
        return sum(c.nbytes for c in self.classes)

    @property
    def empty(self) -> bool:
        return self.num_ranges == 0


@dataclass(frozen=True, eq=False)
class PullPlan:
    """What one local (decode) rank reads for one request, split by remote (prefill) rank.

    ``per_rank[r]``: the :class:`TransferPlan` read from remote rank ``r``; its ``ranges[i]``
    is region ``i`` (empty when region ``i`` is not read from ``r``), its
    ``local_kernel_blocks[g]`` the local kernel blocks of group ``g`` it writes (empty when no
    region of ``g`` is read from ``r``). ``notify_ranks``: every remote rank this local rank
    notifies when done: the ranks it reads from, plus ``r % local_tp == local_rank`` so that
    every remote rank (MLA, deduplicated heads, a full prefix hit) is notified by someone.
    ``local_kernel_blocks[g]`` / ``remote_kernel_blocks[g]``: the paired kernel IDs of group
    ``g``, sorted by local ID, shape ``(k_g,)`` each; when the group's kernel block sizes
    differ (re-blocked at the chunk, :mod:`kvxferd.blocks.reblock`) they are not paired 1:1
    but each side's distinct kernel blocks, sorted, and may differ in length.

    All arrays are read-only: regions of identical geometry share their range arrays (every
    layer of a per-layer model), so a plan costs ``O(blocks)`` memory, not ``blocks x layers``.
    """

    local_tp: tuple[int, int]  # (rank, size)
    remote_tp: tuple[int, int]
    tp_ratio: int
    per_rank: Mapping[int, TransferPlan]
    notify_ranks: tuple[int, ...]
    local_kernel_blocks: tuple[Int64Array, ...]
    remote_kernel_blocks: tuple[Int64Array, ...]

    @property
    def read_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.per_rank))

    @property
    def num_ranges(self) -> int:
        return sum(p.num_ranges for p in self.per_rank.values())

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.per_rank.values())

    @property
    def naive_descriptors(self) -> int:
        return sum(p.naive_descriptors for p in self.per_rank.values())

    @property
    def empty(self) -> bool:
        """Nothing to read (a full prefix hit); the notifications are still due."""
        return self.num_ranges == 0


def frozen(a: Int64Array) -> Int64Array:
    """``a``, made read-only (the planner's arrays are shared between plans)."""
    a.flags.writeable = False
    return a


_EMPTY = frozen(np.zeros(0, dtype=np.int64))
