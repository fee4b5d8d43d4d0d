"""Block math: expand, bounds-check, trim, TP-slice and coalesce block IDs into byte ranges.

Owns the pure arithmetic between "the scheduler's logical block IDs" and "the byte ranges a
pull reads": numbers in, numbers out, vectorised with NumPy.

* :mod:`.expand`   logical <-> kernel block IDs (each side with its **own** ``ppl``)
* :mod:`.bounds`   block-ID validation against registered counts (before any range exists)
* :mod:`.trim`     pairing one group's local and remote IDs (prefix-caching end-trim,
  ``ppl``-mismatch front-keep, state groups element-wise)
* :mod:`.tp`       heterogeneous tensor parallelism: head ranges, source ranks, segments
* :mod:`.coalesce` paired kernel IDs + per-block segments -> merged byte ranges per region
* :mod:`.plan`     :func:`plan_pull`, the entry point, returning a :class:`PullPlan`
* :mod:`.ranges`   the output types (:class:`RegionRanges`, :class:`TransferPlan`)

Must not import: torch, nixl, grpc, asyncio, anything that does I/O or logging, or any
other kvxferd package except :mod:`kvxferd.errors` and :mod:`kvxferd.layout`.
"""

from __future__ import annotations

from kvxferd.blocks.bounds import DEFAULT_MAX_IDS, check_block_ids
from kvxferd.blocks.coalesce import Runs, coalesce, find_runs, region_ranges
from kvxferd.blocks.expand import expand_group, kernel_to_logical, logical_to_kernel
from kvxferd.blocks.plan import plan_pull
from kvxferd.blocks.ranges import PullPlan, RegionRanges, TransferPlan
from kvxferd.blocks.tp import (
    RankSegments,
    head_sources,
    infer_num_kv_heads,
    kv_head_range,
    region_segments,
    tp_ratio,
)
from kvxferd.blocks.trim import pair_group

__all__ = [
    "DEFAULT_MAX_IDS",
    "PullPlan",
    "RankSegments",
    "RegionRanges",
    "Runs",
    "TransferPlan",
    "check_block_ids",
    "coalesce",
    "expand_group",
    "find_runs",
    "head_sources",
    "infer_num_kv_heads",
    "kernel_to_logical",
    "kv_head_range",
    "logical_to_kernel",
    "pair_group",
    "plan_pull",
    "region_ranges",
    "region_segments",
    "tp_ratio",
]
