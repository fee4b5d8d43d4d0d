"""Build a spec from live torch tensors, inferring and verifying the layout from strides.

Nothing is guessed from a global default (seed 000): the stride order is read off each tensor,
checked to be blocks-first (the block dim outermost, every block one dense span), and matched
against the layouts kvxferd knows. Anything else is refused with what was found.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvxferd.errors import SpecError
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import GroupKind, KVCacheSpec, KVGroup, Layout, MemoryType, Region

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorLayout:
    """What the strides of one tensor say: layout, block dim and block stride in bytes."""

    layout: Layout
    block_stride: int
    block_len: int


def stride_order(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """Logical dims sorted outermost-first by stride (size-1 dims keep their logical place)."""
    dims = list(range(len(shape)))
    # A size-1 dim's stride is meaningless; give it the stride it would have in logical order.
    eff = list(strides)
    for d in reversed(dims):
        if shape[d] == 1:
            eff[d] = eff[d + 1] * shape[d + 1] if d + 1 < len(shape) else 1
    return tuple(sorted(dims, key=lambda d: (-eff[d], d)))


def infer_layout(
    name: str,
    kind: GroupKind,
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    *,
    prefer: Layout | None = None,
) -> TensorLayout:
    """Infer and verify the layout of a tensor of ``shape``/``strides`` (in elements).

    A layout fits when, in its stride order, every dim inside a block is dense (so one block
    is one contiguous span) and the block dim is outermost with a stride of at least one
    block. Size-1 dims carry no stride information and are skipped, so with one head (or one
    token) per block NHD and HND both fit, their bytes the same: ``prefer`` (the layout a spec
    declares) is taken when it fits, else the first that does.
    """
    where = f"tensor {name!r} (shape {list(shape)}, strides {list(strides)})"
    fitting = [
        lay
        for lay in Layout
        if lay.expected_ndim in (None, len(shape))
        and _kind_allows(kind, lay)
        and _fits(lay.stride_order(len(shape)), shape, strides)
    ]
    if not fitting:
        order = stride_order(shape, strides)
        blocks_first = order[0] == (1 if len(shape) == 6 else 0)
        if not blocks_first:
            hint = "the block dim is not outermost in memory"
            if shape[0] == 2 or (len(shape) > 1 and strides[1] > strides[0]):
                hint += ": this looks like a K/V-first (2, num_blocks, ...) layout"
        else:
            hint = (
                f"stride order {order} is not a blocks-first layout with dense blocks that"
                f" kvxferd knows for a {kind.value} group"
            )
        raise SpecError(
            f"{where}: {hint}",
            fix="register blocks-first tensors with dense blocks: (num_blocks, 2, block_size,"
            " heads, head_size) in NHD or HND order, (layers, num_blocks, ...) cross-layer,"
            " (num_blocks, ...) for MLA and state",
        )
    layout = prefer if prefer in fitting else fitting[0]
    bdim = layout.block_dim
    if layout.has_kv_halves and shape[bdim + 1] != 2:
        hint = " (dim 0 is 2: this looks like a K/V-first layout)" if shape[0] == 2 else ""
        raise SpecError(
            f"{where}: dim {bdim + 1} must be 2 (K and V) but is {shape[bdim + 1]}{hint}",
            fix="register blocks-first tensors: (num_blocks, 2, block_size, heads, head_size)",
        )
    block_len = math.prod(s for i, s in enumerate(shape) if i != bdim) * itemsize
    block_stride = strides[bdim] * itemsize if shape[bdim] > 1 else block_len
    return TensorLayout(layout, block_stride, block_len)


def _fits(order: Sequence[int], shape: Sequence[int], strides: Sequence[int]) -> bool:
    expect = 1
    for d in reversed(order[1:]):
        if shape[d] != 1 and strides[d] != expect:
            return False
        expect *= shape[d]
    bdim = order[0]
    return shape[bdim] == 1 or strides[bdim] >= expect


def _kind_allows(kind: GroupKind, layout: Layout) -> bool:
    if kind.is_state:
        return layout is Layout.STATE
    if kind is GroupKind.MLA:
        return layout is Layout.MLA
    return layout.has_kv_halves


def spec_from_tensors(
    model: str,
    groups: Sequence[KVGroup],
    tensors: Mapping[str, tuple[int, torch.Tensor]],
    prefer: Mapping[str, Layout] | None = None,
) -> KVCacheSpec:
    """Spec of ``tensors``: ``{region name: (group index, tensor)}`` in registration order;
    ``prefer``: per region, the layout to read where the tensor's strides allow more than one
    (:func:`infer_layout`)."""
    regions: list[Region] = []
    for name, (gi, t) in tensors.items():
        if not 0 <= gi < len(groups):
            raise SpecError(
                f"tensor {name!r} names group {gi}; there are {len(groups)}",
                fix="use a declared group index",
            )
        try:
            dtype = KVDType.from_torch_name(str(t.dtype))
        except ValueError as exc:
            raise SpecError(str(exc), field=name) from exc
        want = prefer.get(name) if prefer is not None else None
        tl = infer_layout(name, groups[gi].kind, t.shape, t.stride(), dtype.itemsize, prefer=want)
        memory = MemoryType.VRAM if t.device.type == "cuda" else MemoryType.DRAM
        regions.append(
            Region(
                name=name,
                group=gi,
                dtype=dtype,
                layout=tl.layout,
                shape=tuple(t.shape),
                memory=memory,
                block_stride=tl.block_stride if tl.block_stride != tl.block_len else 0,
            )
        )
    return KVCacheSpec(model, tuple(groups), tuple(regions))
