"""What of a region is TP-invariant: its layout family and its shape per KV head.

Heterogeneous TP changes how many KV heads an attention region holds per rank and nothing
else; MLA latents and Mamba states are replicated, so their whole inner shape is invariant.
"""

from __future__ import annotations

from kvxferd.layout.spec import Layout, Region

_FAMILY = {
    Layout.NHD: "attention",
    Layout.HND: "attention",
    Layout.CROSS_LAYER_NHD: "cross-layer attention",
    Layout.CROSS_LAYER_HND: "cross-layer attention",
    Layout.MLA: "MLA",
    Layout.STATE: "state",
}


def layout_family(layout: Layout) -> str:
    """Layouts one explicit conversion kernel can map onto each other (NHD <-> HND)."""
    return _FAMILY[layout]


def invariant_shape(region: Region, *, with_tokens: bool = True) -> tuple[int, ...]:
    """The region's shape without the block dim and, for attention, without the heads dim.

    NHD/HND ``(num_blocks, 2, block_size, heads, head_size)`` gives ``(2, block_size,
    head_size)``; cross-layer ``(layers, num_blocks, 2, block_size, heads, head_size)`` gives
    ``(layers, 2, block_size, head_size)``; MLA and state regions keep every non-block dim.
    ``with_tokens=False`` also drops the tokens-per-block dim of attention and MLA regions
    (kernel block sizes may differ between peers: pulls re-block, docs/domain.md §5).
    """
    drop = {region.layout.block_dim}
    if region.layout.has_kv_halves:
        drop.add(len(region.shape) - 2)
    if not with_tokens and region.tokens_per_block:
        drop.add(region.layout.block_dim + (2 if region.layout.has_kv_halves else 1))
    return tuple(d for i, d in enumerate(region.shape) if i not in drop)
