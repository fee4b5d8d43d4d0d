"""Block views, the NHD/HND permute, and the input checks shared by both implementations.

A *region* here is a 2-D ``uint8`` view ``(num_blocks, block_len)`` with strides
``(block_stride, 1)``: block ``b`` is ``block_len`` contiguous bytes at ``base + b *
block_stride`` (the geometry of :class:`kvxferd.layout.spec.Region`). :func:`block_view` makes one
from a KV cache tensor and its :class:`~kvxferd.layout.spec.Layout`:

* per layer, NHD: ``(num_blocks, 2, block_size, num_kv_heads, head_size)``, stride order
  ``(0, 1, 2, 3, 4)``; HND: same logical shape, stride order ``(0, 1, 3, 2, 4)``.
* cross-layer: ``(num_layers, num_blocks, 2, block_size, num_kv_heads, head_size)``, stride
  order ``(1, 0, 2, 3, 4, 5)`` (NHD inside) or ``(1, 0, 2, 4, 3, 5)`` (HND inside): one block
  is every layer of it.

The *staging* buffer of a request of ``n`` block IDs is ``n`` rows of ``row_bytes =
sum(block_len)`` bytes: row ``i`` is region 0's block ``ids[i]``, then region 1's, and so on.
The staging buffer therefore holds the request in cross-layer form, and a chunk of rows
``[a, b)`` is the contiguous byte range ``[a * row_bytes, b * row_bytes)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt
import torch

from kvxferd.errors import BlockRangeError, InvalidRequest
from kvxferd.layout.spec import Layout, Region

BlockIds = npt.NDArray[np.integer] | torch.Tensor | Sequence[int]


class HeadOrder(StrEnum):
    """Order of tokens and heads inside one K or V half of a block."""

    NHD = "NHD"  # tokens outer, heads inner
    HND = "HND"  # heads outer: one head's tokens contiguous

    @property
    def other(self) -> HeadOrder:
        return HeadOrder.HND if self is HeadOrder.NHD else HeadOrder.NHD


@dataclass(frozen=True)
class KVPermute:
    """Swap tokens and heads inside every K/V half while copying: ``src`` order -> the other.

    A half is ``block_size x num_heads`` head vectors of ``head_bytes`` bytes; a block holds
    ``block_len / half_bytes`` halves (2 per layer; 2 x layers for a cross-layer block).
    ``src`` is the order of the side being *read*: the regions for a gather, the staging buffer
    for a scatter. ``reverse()`` undoes it.
    """

    src: HeadOrder
    block_size: int
    num_heads: int
    head_bytes: int

    def __post_init__(self) -> None:
        if min(self.block_size, self.num_heads, self.head_bytes) <= 0:
            raise InvalidRequest(
                f"permute dims must be positive, got block_size={self.block_size}"
                f" num_heads={self.num_heads} head_bytes={self.head_bytes}",
                field="permute",
            )

    @property
    def dst(self) -> HeadOrder:
        return self.src.other

    @property
    def half_bytes(self) -> int:
        return self.block_size * self.num_heads * self.head_bytes

    @property
    def src_dims(self) -> tuple[int, int]:
        """``(outer, inner)`` item counts of a half as the source holds it."""
        if self.src is HeadOrder.NHD:
            return self.block_size, self.num_heads
        return self.num_heads, self.block_size

    def kernel_args(self) -> list[int]:
        """``[A, B, unit_bytes]`` for the CUDA launcher (source half is A x B items)."""
        a, b = self.src_dims
        return [a, b, self.head_bytes]

    def reverse(self) -> KVPermute:
        return KVPermute(self.dst, self.block_size, self.num_heads, self.head_bytes)

    @classmethod
    def from_region(cls, region: Region) -> KVPermute:
        """The permute that turns ``region``'s head order into the other one."""
        if not region.layout.has_kv_halves:
            raise InvalidRequest(
                f"region {region.describe()} has no K/V halves to permute", field="permute"
            )
        return cls(
            HeadOrder.HND if region.layout.head_major else HeadOrder.NHD,
            region.tokens_per_block,
            region.num_kv_heads,
            region.head_size * region.dtype.itemsize,
        )


def block_view(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The ``(num_blocks, block_len)`` ``uint8`` view of a KV tensor in ``layout`` (no copy).

    Raises :class:`InvalidRequest` when the tensor's memory is not blocks-first with each block
    one contiguous span (what ``layout`` promises).
    """
    want = layout.expected_ndim
    if want is not None and tensor.dim() != want:
        raise InvalidRequest(
            f"a {layout.value} tensor is {want}-D, got shape {list(tensor.shape)}",
            field="regions",
        )
    phys = tensor.permute(layout.stride_order(tensor.dim()))
    num_blocks = phys.shape[0]
    try:
        return phys.view(torch.uint8).view(num_blocks, -1)
    except RuntimeError as exc:
        raise InvalidRequest(
            f"tensor of shape {list(tensor.shape)} and strides {list(tensor.stride())} is not"
            f" a blocks-first {layout.value} cache with contiguous blocks ({exc})",
            field="regions",
            fix="allocate the cache in the layout's physical order (see kvxferd.layout.spec)",
        ) from exc


def row_bytes(regions: Sequence[torch.Tensor]) -> int:
    """Bytes of one staging row (one block ID across every region)."""
    return sum(int(r.shape[1]) for r in regions)


@dataclass(frozen=True)
class Checked:
    """A validated call: the IDs as a 1-D int64 CPU tensor and each region's offset in a row."""

    ids: torch.Tensor
    offsets: tuple[int, ...]
    row_bytes: int


def _ids_array(block_ids: BlockIds) -> npt.NDArray[np.int64]:
    if isinstance(block_ids, torch.Tensor):
        if block_ids.device.type != "cpu":
            raise InvalidRequest(
                f"block IDs must be on the host (they are checked there), got {block_ids.device}",
                field="block_ids",
                fix="pass a NumPy array or CPU tensor",
            )
        if block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
            raise InvalidRequest(
                f"block IDs must be integers, got {block_ids.dtype}", field="block_ids"
            )
        arr = block_ids.numpy()
    else:
        arr = np.asarray(block_ids)
        if arr.size == 0:
            arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise InvalidRequest(f"block IDs must be 1-D, got shape {arr.shape}", field="block_ids")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequest(f"block IDs must be integers, got {arr.dtype}", field="block_ids")
    return np.ascontiguousarray(arr, dtype=np.int64)


def check_call(
    regions: Sequence[torch.Tensor],
    block_ids: BlockIds,
    staging: torch.Tensor,
    permute: KVPermute | None,
    *,
    op: str,
    unique: bool,
) -> Checked:
    """Check every input of a gather/scatter before anything runs; raise typed errors.

    ``unique``: refuse repeated IDs (a scatter writing one block twice has no defined result).
    """
    if not regions:
        raise InvalidRequest(f"{op}: no regions", field="regions")
    if not isinstance(staging, torch.Tensor) or staging.dtype != torch.uint8:
        raise InvalidRequest(f"{op}: the staging buffer must be a uint8 tensor", field="staging")
    if not staging.is_contiguous():
        raise InvalidRequest(f"{op}: the staging buffer must be contiguous", field="staging")
    offsets: list[int] = []
    total = 0
    for i, r in enumerate(regions):
        where = f"regions[{i}]"
        if r.dtype != torch.uint8 or r.dim() != 2:
            raise InvalidRequest(
                f"{op}: {where} must be a 2-D uint8 block view, got {r.dtype} {list(r.shape)}",
                field=where,
                fix="make it with kvxferd.kernels.block_view(tensor, layout)",
            )
        nb, blen = int(r.shape[0]), int(r.shape[1])
        if nb == 0 or blen == 0:
            raise InvalidRequest(f"{op}: {where} is empty ({list(r.shape)})", field=where)
        if r.stride(1) != 1 or r.stride(0) < blen:
            raise InvalidRequest(
                f"{op}: {where} has strides {list(r.stride())}: blocks must be contiguous and"
                f" must not overlap (block_len {blen})",
                field=where,
            )
        if r.device != staging.device:
            raise InvalidRequest(
                f"{op}: {where} is on {r.device}, the staging buffer on {staging.device}",
                field=where,
                fix="gather and scatter on the device that holds the regions",
            )
        if permute is not None and blen % permute.half_bytes:
            raise InvalidRequest(
                f"{op}: {where} block_len {blen} is not a whole number of K/V halves of"
                f" {permute.half_bytes} bytes",
                field="permute",
            )
        offsets.append(total)
        total += blen
    ids = _ids_array(block_ids)
    if ids.size:
        for i, r in enumerate(regions):
            nb = int(r.shape[0])
            bad = np.flatnonzero((ids < 0) | (ids >= nb))
            if bad.size:
                k = int(bad[0])
                raise BlockRangeError(
                    f"{op}: block ID {int(ids[k])} at index {k} is outside regions[{i}]"
                    f" ({nb} blocks); {bad.size} ID(s) out of range",
                    field=f"block_ids[{k}]",
                )
        if unique and np.unique(ids).size != ids.size:
            raise BlockRangeError(f"{op}: block IDs repeat", field="block_ids")
    if staging.numel() != ids.size * total:
        raise InvalidRequest(
            f"{op}: the staging buffer has {staging.numel()} bytes, expected {ids.size} IDs x"
            f" {total} bytes per row",
            field="staging",
        )
    return Checked(torch.from_numpy(ids), tuple(offsets), total)
