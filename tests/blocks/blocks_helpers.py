"""Spec builders and a byte-level executor for the block-math tests (no I/O, no torch)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt
from hypothesis import HealthCheck, settings

from kvxferd.blocks.ranges import TransferPlan
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import GroupKind, KVCacheSpec, KVGroup, Layout, Region

FA = GroupKind.FULL_ATTENTION
SWA = GroupKind.SLIDING_WINDOW
MAMBA = GroupKind.MAMBA
MLA = GroupKind.MLA


def group(name: str, kind: GroupKind, ppl: int, kernel: int = 16) -> KVGroup:
    """A group with ``ppl`` kernel blocks of ``kernel`` tokens per logical block."""
    return KVGroup(name, kind, logical_block_size=ppl * kernel, kernel_block_size=kernel)


def attn_region(
    name: str,
    grp: int,
    num_blocks: int,
    *,
    kernel: int = 16,
    heads: int = 2,
    head_size: int = 4,
    layout: Layout = Layout.NHD,
    dtype: KVDType = KVDType.BF16,
    layers: int = 1,
    block_stride: int = 0,
) -> Region:
    """Attention region; cross-layer when ``layout`` is a cross-layer layout."""
    inner = (2, kernel, heads, head_size)
    shape = (layers, num_blocks, *inner) if layout.is_cross_layer else (num_blocks, *inner)
    return Region(name, grp, dtype, layout, shape, block_stride=block_stride)


def state_region(name: str, grp: int, num_blocks: int, state: int = 8) -> Region:
    return Region(name, grp, KVDType.FP32, Layout.STATE, (num_blocks, state))


def mla_region(name: str, grp: int, num_blocks: int, kernel: int = 16, latent: int = 8) -> Region:
    return Region(name, grp, KVDType.BF16, Layout.MLA, (num_blocks, kernel, latent))


def spec(groups: Sequence[KVGroup], regions: Sequence[Region], model: str = "m") -> KVCacheSpec:
    return KVCacheSpec(model, tuple(groups), tuple(regions))


def execute(
    plan: TransferPlan,
    local: Sequence[npt.NDArray[np.uint8]],
    remote: Sequence[npt.NDArray[np.uint8]],
) -> None:
    """Copy every planned range from ``remote[region]`` into ``local[region]`` (flat bytes)."""
    for rg in plan.ranges:
        dst, src = local[rg.region], remote[rg.region]
        for lo, ro, n in zip(
            rg.local_offset.tolist(), rg.remote_offset.tolist(), rg.length.tolist(), strict=True
        ):
            assert lo >= 0 and lo + n <= dst.shape[0]
            assert ro >= 0 and ro + n <= src.shape[0]
            dst[lo : lo + n] = src[ro : ro + n]


def execute_all(
    per_rank: Mapping[int, TransferPlan],
    local: Sequence[npt.NDArray[np.uint8]],
    remote_by_rank: Mapping[int, Sequence[npt.NDArray[np.uint8]]],
) -> None:
    for r, plan in per_rank.items():
        execute(plan, local, remote_by_rank[r])


PROPS = settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
"""Hypothesis settings for the block-math properties (no deadline: first calls import NumPy)."""
