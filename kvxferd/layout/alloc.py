"""Allocate torch tensors laid out exactly as a spec says (owned pools, tests, benchmarks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvxferd.errors import SpecError
from kvxferd.layout.spec import KVCacheSpec, Region

if TYPE_CHECKING:
    import torch


def allocate_region(region: Region, device: str = "cpu") -> torch.Tensor:
    """A zeroed tensor with ``region``'s logical shape and physical stride order.

    The memory is allocated in physical order and viewed in logical order, so
    ``kvxferd.layout.tensors.infer_layout`` reads the same layout back.
    """
    import torch

    if region.block_stride and region.block_stride != region.block_len:
        raise SpecError(
            f"region {region.name!r} has padded blocks (stride {region.block_stride} >"
            f" length {region.block_len}); kvxferd only allocates dense pools",
            fix="leave block_stride out for pools the daemon owns",
        )
    order = region.stride_order
    physical = [region.shape[d] for d in order]
    dtype = getattr(torch, region.dtype.torch_name)
    t = torch.zeros(physical, dtype=dtype, device=device)
    inverse = [order.index(d) for d in range(len(order))]
    return t.permute(inverse)


def allocate_pool(spec: KVCacheSpec, device: str = "cpu") -> dict[str, torch.Tensor]:
    """One tensor per region, in registration order."""
    return {r.name: allocate_region(r, device) for r in spec.regions}
