"""Plan construction for benchmarks and tests, straight from NumPy.

One small function so it can be swapped for :func:`kvxferd.blocks.plan_pull` once the planner
is wired in: it pairs local and remote kernel block IDs 1:1 in every region (layer) of a
blocks-first layout, one range per (region, block), and leaves coalescing to the engine.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.ranges import RegionRanges, TransferPlan


def plan_from_blocks(
    local_blocks: npt.ArrayLike,
    remote_blocks: npt.ArrayLike,
    *,
    num_regions: int,
    block_len: int,
    block_stride: int | None = None,
) -> TransferPlan:
    """One range of ``block_len`` bytes per (region, block pair); block ``b`` of a region
    starts at ``b * block_stride`` (``block_stride`` defaults to ``block_len``)."""
    lb = np.asarray(local_blocks, dtype=np.int64)
    rb = np.asarray(remote_blocks, dtype=np.int64)
    if lb.shape != rb.shape or lb.ndim != 1:
        raise ValueError("local and remote block lists must be 1-D of equal length")
    stride = block_len if block_stride is None else block_stride
    length = np.full(lb.shape, block_len, dtype=np.int64)
    ranges = tuple(
        RegionRanges(r, f"layer{r}", lb * stride, rb * stride, length) for r in range(num_regions)
    )
    return TransferPlan(
        ranges, local_kernel_blocks=(lb,), naive_descriptors=num_regions * int(lb.size)
    )
