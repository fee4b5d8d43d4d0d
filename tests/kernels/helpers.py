"""KV tensors in every layout, filled with random bytes, for the staging kernel tests."""

from __future__ import annotations

import torch

from kvxferd.kernels import block_view
from kvxferd.layout.spec import Layout

# (num_blocks, 2, block_size, heads, head_size) per layer
SHAPE = (24, 2, 4, 2, 16)


def random_bytes(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill ``t`` with random bytes drawn on ``t``'s device (``gen`` seeds a local generator)."""
    raw = t.view(torch.uint8)
    local = torch.Generator(device=t.device)
    local.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=t.device, generator=local))
    return t


def kv_tensors(
    layout: Layout,
    *,
    layers: int,
    gen: torch.Generator,
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    shape: tuple[int, ...] = SHAPE,
) -> list[torch.Tensor]:
    """Logical-shape tensors in ``layout``'s physical order (one per layer, or one cross-layer)."""
    order = layout.stride_order(len(shape) + (1 if layout.is_cross_layer else 0))
    logical = (layers, *shape) if layout.is_cross_layer else shape
    count = 1 if layout.is_cross_layer else layers
    out = []
    for _ in range(count):
        phys_shape = [logical[d] for d in order]
        phys = random_bytes(torch.empty(phys_shape, dtype=dtype, device=device), gen)
        inv = [order.index(d) for d in range(len(order))]
        out.append(phys.permute(inv))
    return out


def views(tensors: list[torch.Tensor], layout: Layout) -> list[torch.Tensor]:
    return [block_view(t, layout) for t in tensors]
