"""Spec and peer builders shared by the peers tests."""

from __future__ import annotations

from kvxferd.layout import GroupKind, KVCacheSpec, KVDType, KVGroup, Layout, Region
from kvxferd.peers import PeerInfo


def attn(
    *,
    model: str = "llama",
    heads: int = 8,
    head_size: int = 64,
    block: int = 16,
    layers: int = 4,
    layout: Layout = Layout.HND,
    dtype: KVDType = KVDType.BF16,
    num_blocks: int = 32,
    dtypes: dict[int, KVDType] | None = None,
) -> KVCacheSpec:
    """A one-group attention spec: ``layers`` per-layer regions ``layer.i``."""
    group = KVGroup("full", GroupKind.FULL_ATTENTION, block, block)
    regions = tuple(
        Region(
            f"layer.{i}",
            0,
            (dtypes or {}).get(i, dtype),
            layout,
            (num_blocks, 2, block, heads, head_size),
        )
        for i in range(layers)
    )
    return KVCacheSpec(model, (group,), regions)


def peer(
    spec: KVCacheSpec,
    *,
    tp: int = 1,
    rank: int = 0,
    prefix: bool = False,
    version: int | None = None,
    num_kv_heads: int | None = None,
    name: str = "",
) -> PeerInfo:
    if version is None:
        return PeerInfo(
            spec=spec,
            tp_rank=rank,
            tp_size=tp,
            prefix_caching=prefix,
            num_kv_heads=num_kv_heads,
            name=name,
        )
    return PeerInfo(
        spec=spec,
        tp_rank=rank,
        tp_size=tp,
        prefix_caching=prefix,
        protocol_version=version,
        num_kv_heads=num_kv_heads,
        name=name,
    )
