"""The output of planning: byte ranges to move, per region, as NumPy arrays.

A plan never holds per-descriptor Python objects: each region's ranges are three parallel
``int64`` arrays, so building descriptors from a plan is one vectorised add of base addresses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import numpy.typing as npt

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True)
class RegionRanges:
    """Byte ranges for one region pair (regions pair by index: same name, same order).

    ``local_offset[i]`` / ``remote_offset[i]`` are byte offsets from each side's region base,
    ``length[i]`` the bytes of range ``i``. Ranges never cross a region's end.
    """

    region: int
    name: str
    local_offset: Int64Array
    remote_offset: Int64Array
    length: Int64Array

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
        )
        return rr

    @property
    def num_ranges(self) -> int:
        return int(self.length.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())


@dataclass(frozen=True)
class TransferPlan:
    """Everything a pull moves: byte ranges per region plus the local kernel blocks written.

    ``local_kernel_blocks[g]`` lists, per KV group ``g``, the local kernel block IDs the plan
    writes (the blocks that become invalid if the transfer fails). ``naive_descriptors`` is how
    many descriptors one-per-(region, kernel block) would have taken, for telemetry.
    """

    ranges: tuple[RegionRanges, ...]
    local_kernel_blocks: tuple[Int64Array, ...] = field(default=())
    naive_descriptors: int = 0

    @cached_property
    def shared(self) -> tuple[tuple[RegionRanges, ...], ...]:
        """The non-empty regions grouped by the arrays they share (the planner gives regions
        of one geometry the same arrays: typically every layer), each group in region order
        and the groups in the order of their first region; found once per plan, by identity,
        unless the plan was made with them (:meth:`grouped`, as the planner does)."""
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

    @classmethod
    def grouped(
        cls,
        ranges: tuple[RegionRanges, ...],
        local_kernel_blocks: tuple[Int64Array, ...],
        naive_descriptors: int,
        shared: tuple[tuple[RegionRanges, ...], ...],
    ) -> TransferPlan:
        """A plan whose :attr:`shared` grouping its maker already knows (the planner: one group
        per geometry class with ranges), so that it is not found again by identity."""
        plan = cls(ranges, local_kernel_blocks, naive_descriptors)
        plan.__dict__["shared"] = shared  # what the cached_property would store
        return plan

    @cached_property
    def num_ranges(self) -> int:
        return sum(r.num_ranges for r in self.ranges)

    @cached_property
    def nbytes(self) -> int:
        # Regions sharing the planner's arrays: each distinct array summed once.
        return sum(g[0].nbytes * len(g) for g in self.shared)

    @property
    def empty(self) -> bool:
        return self.num_ranges == 0
