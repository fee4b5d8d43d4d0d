"""View raw shared bytes as a region's tensor, dense (per spec) or with given strides."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvxferd.errors import SpecError
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import Region


def region_tensor(region: Region, raw: torch.Tensor) -> torch.Tensor:
    """``raw`` (uint8, at least ``region.nbytes``) viewed with ``region``'s logical shape and
    physical stride order, exactly as :func:`kvxferd.layout.alloc.allocate_region` lays it out.
    """
    if region.block_stride and region.block_stride != region.block_len:
        raise SpecError(
            f"region {region.name!r} has padded blocks (stride {region.block_stride} >"
            f" length {region.block_len}); the daemon only allocates dense pools",
            fix="leave block_stride out for an OWNED attach, or attach IMPORTED memory",
        )
    if raw.numel() < region.nbytes:
        raise SpecError(
            f"region {region.name!r} needs {region.nbytes} bytes, the shared memory has"
            f" {raw.numel()}",
            fix="size the shared memory for the spec",
        )
    dtype = getattr(torch, region.dtype.torch_name)
    order = region.stride_order
    physical = [region.shape[d] for d in order]
    t = raw[: region.nbytes].view(dtype).view(physical)
    inverse = [order.index(d) for d in range(len(order))]
    return t.permute(inverse)


def strided_tensor(
    raw: torch.Tensor,
    dtype: KVDType,
    shape: Sequence[int],
    strides: Sequence[int],
    what: str,
) -> torch.Tensor:
    """``raw`` (uint8, starting at element 0) viewed as ``dtype`` with ``shape``/``strides``
    (in elements); refuses views that would reach past ``raw`` or have negative strides."""
    if len(shape) != len(strides) or not shape:
        raise SpecError(
            f"{what}: shape {list(shape)} and strides {list(strides)} differ in length",
            fix="send the tensor's shape and strides as torch reports them",
        )
    if any(s < 0 for s in strides) or any(n <= 0 for n in shape):
        raise SpecError(
            f"{what}: shape {list(shape)} / strides {list(strides)} must be positive",
            fix="attach a tensor with positive sizes and non-negative strides",
        )
    extent = (sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1) * dtype.itemsize
    if extent > raw.numel():
        raise SpecError(
            f"{what}: a {dtype.value} tensor of shape {list(shape)} and strides {list(strides)}"
            f" spans {extent} bytes, but the shared memory holds only {raw.numel()} bytes past"
            " the offset",
            fix="pass the right offset, or share the whole allocation the tensor lives in",
        )
    usable = raw.numel() // dtype.itemsize * dtype.itemsize
    typed = raw[:usable].view(getattr(torch, dtype.torch_name))
    return typed.as_strided(tuple(shape), tuple(strides))
