"""The KV cache spec as immutable values: groups, regions, layouts.

Shapes are documented the way FlashInfer documents caches, logical dims first:

* attention, per layer, ``NHD``: ``(num_blocks, 2, block_size, num_kv_heads, head_size)``,
  stride order ``(0, 1, 2, 3, 4)``: inside each K or V half, tokens then heads.
* attention, per layer, ``HND``: same logical shape, stride order ``(0, 1, 3, 2, 4)``: heads
  outermost inside each half, so one head's tokens are contiguous (head-sliceable for TP).
* attention, cross-layer: ``(num_layers, num_blocks, 2, block_size, num_kv_heads, head_size)``
  with stride order ``(1, 0, 2, 3, 4, 5)`` (NHD inside) or ``(1, 0, 2, 4, 3, 5)`` (HND inside):
  every layer of one block is one contiguous span.
* MLA: ``(num_blocks, block_size, latent_dim)``, identity order, replicated across TP ranks.
* Mamba / SSM state: ``(num_blocks, *state_shape)``, identity order; a block is one state.

``num_blocks`` always counts **kernel** blocks: the unit the registered tensor is addressed in.
A block of one region is ``block_len`` contiguous bytes starting at ``base + b * block_stride``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any

from kvxferd.errors import SpecError
from kvxferd.layout.dtypes import KVDType


class GroupKind(StrEnum):
    """What a KV cache group holds; decides how its block IDs are expanded and trimmed."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MLA = "mla"
    MAMBA = "mamba"

    @property
    def is_state(self) -> bool:
        """State groups (Mamba/SSM): a block is a whole state, never split or trimmed."""
        return self is GroupKind.MAMBA


class MemoryType(StrEnum):
    DRAM = "DRAM"
    VRAM = "VRAM"


class Layout(StrEnum):
    """Physical arrangement of one region, always blocks-first."""

    NHD = "NHD"
    HND = "HND"
    CROSS_LAYER_NHD = "CROSS_LAYER_NHD"
    CROSS_LAYER_HND = "CROSS_LAYER_HND"
    MLA = "MLA"
    STATE = "STATE"

    @property
    def is_cross_layer(self) -> bool:
        return self in (Layout.CROSS_LAYER_NHD, Layout.CROSS_LAYER_HND)

    @property
    def has_kv_halves(self) -> bool:
        return self in (Layout.NHD, Layout.HND, Layout.CROSS_LAYER_NHD, Layout.CROSS_LAYER_HND)

    @property
    def head_major(self) -> bool:
        """True when one head's data is contiguous inside each K/V half (HND)."""
        return self in (Layout.HND, Layout.CROSS_LAYER_HND)

    def stride_order(self, ndim: int) -> tuple[int, ...]:
        """The stride order (physical dims, outermost first) for a logical rank ``ndim``."""
        if self is Layout.HND:
            return (0, 1, 3, 2, 4)
        if self is Layout.CROSS_LAYER_NHD:
            return (1, 0, 2, 3, 4, 5)
        if self is Layout.CROSS_LAYER_HND:
            return (1, 0, 2, 4, 3, 5)
        return tuple(range(ndim))

    @property
    def expected_ndim(self) -> int | None:
        if self in (Layout.NHD, Layout.HND):
            return 5
        if self.is_cross_layer:
            return 6
        if self is Layout.MLA:
            return 3
        return None  # STATE: any rank >= 2

    @property
    def block_dim(self) -> int:
        """The logical dim that indexes blocks."""
        return 1 if self.is_cross_layer else 0


_ATTENTION = frozenset({Layout.NHD, Layout.HND, Layout.CROSS_LAYER_NHD, Layout.CROSS_LAYER_HND})
_KIND_LAYOUTS: dict[GroupKind, frozenset[Layout]] = {
    GroupKind.FULL_ATTENTION: _ATTENTION,
    GroupKind.SLIDING_WINDOW: _ATTENTION,
    GroupKind.MLA: frozenset({Layout.MLA}),
    GroupKind.MAMBA: frozenset({Layout.STATE}),
}


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: its kind and block sizes (in tokens).

    ``ppl`` (kernel blocks per logical block) = ``logical_block_size // kernel_block_size``.
    State groups are never expanded: their ``ppl`` is 1 whatever the sizes say.
    """

    name: str
    kind: GroupKind
    logical_block_size: int
    kernel_block_size: int

    def __post_init__(self) -> None:
        where = f"group {self.name!r}"
        if not self.name:
            raise SpecError("a group has an empty name", fix="give every group a unique name")
        if self.logical_block_size <= 0 or self.kernel_block_size <= 0:
            raise SpecError(
                f"{where}: block sizes must be positive, got logical {self.logical_block_size}"
                f" and kernel {self.kernel_block_size}",
                fix="set logical_block_size and kernel_block_size to token counts >= 1",
            )
        if not self.kind.is_state and self.logical_block_size % self.kernel_block_size:
            raise SpecError(
                f"{where}: logical block size {self.logical_block_size} is not a multiple of"
                f" the kernel block size {self.kernel_block_size}",
                fix="pick a kernel block size that divides the logical block size",
            )

    @property
    def ppl(self) -> int:
        return 1 if self.kind.is_state else self.logical_block_size // self.kernel_block_size


@dataclass(frozen=True)
class Region:
    """One registered tensor: a layer (or all layers, cross-layer) of one group.

    ``shape`` is the logical shape (see the module docstring); ``num_blocks`` counts kernel
    blocks. ``block_stride`` is the byte distance between consecutive blocks, at least
    ``block_len``; it equals ``block_len`` for a dense tensor.
    """

    name: str
    group: int
    dtype: KVDType
    layout: Layout
    shape: tuple[int, ...]
    memory: MemoryType = MemoryType.DRAM
    block_stride: int = 0  # 0: dense, i.e. equal to block_len

    def __post_init__(self) -> None:
        where = f"region {self.name!r}"
        if not self.name:
            raise SpecError("a region has an empty name", fix="name every region uniquely")
        if any(d <= 0 for d in self.shape):
            raise SpecError(
                f"{where}: every dim must be >= 1, got shape {list(self.shape)}",
                fix="check the region's shape",
            )
        want = self.layout.expected_ndim
        if want is not None and len(self.shape) != want:
            raise SpecError(
                f"{where}: layout {self.layout.value} needs a {want}-D shape, got"
                f" {len(self.shape)}-D {list(self.shape)}",
                fix=f"give the logical shape of a {self.layout.value} region (see docs/spec.md)",
            )
        if self.layout is Layout.STATE and len(self.shape) < 2:
            raise SpecError(
                f"{where}: a state region needs (num_blocks, *state_shape), got {list(self.shape)}",
                fix="add the state dims after the block dim",
            )
        if self.layout.has_kv_halves and self.shape[self.layout.block_dim + 1] != 2:
            raise SpecError(
                f"{where}: the dim after the block dim must be 2 (K and V), got shape"
                f" {list(self.shape)}",
                fix="attention regions are (num_blocks, 2, block_size, heads, head_size)",
            )
        if self.block_stride and self.block_stride < self.block_len:
            raise SpecError(
                f"{where}: block_stride {self.block_stride} is smaller than block_len"
                f" {self.block_len}: blocks would overlap",
                fix="leave block_stride out for a dense tensor",
            )

    @property
    def stride_order(self) -> tuple[int, ...]:
        return self.layout.stride_order(len(self.shape))

    @property
    def num_blocks(self) -> int:
        """Kernel blocks in this region."""
        return self.shape[self.layout.block_dim]

    @property
    def num_layers(self) -> int:
        return self.shape[0] if self.layout.is_cross_layer else 1

    @functools.cached_property
    def block_len(self) -> int:
        """Bytes of one block (all layers of it, for a cross-layer region)."""
        inner = [d for i, d in enumerate(self.shape) if i != self.layout.block_dim]
        return math.prod(inner) * self.dtype.itemsize

    @functools.cached_property
    def stride(self) -> int:
        """Bytes between the starts of consecutive blocks."""
        return self.block_stride or self.block_len

    @property
    def nbytes(self) -> int:
        """Bytes spanned by the registered region."""
        return (self.num_blocks - 1) * self.stride + self.block_len

    @property
    def num_kv_heads(self) -> int:
        return self.shape[-2] if self.layout.has_kv_halves else 1

    @property
    def head_size(self) -> int:
        return self.shape[-1] if self.layout.has_kv_halves else 0

    @property
    def tokens_per_block(self) -> int:
        if self.layout.has_kv_halves:
            return self.shape[self.layout.block_dim + 2]
        if self.layout is Layout.MLA:
            return self.shape[1]
        return 0

    def with_num_blocks(self, num_blocks: int) -> Region:
        shape = list(self.shape)
        shape[self.layout.block_dim] = num_blocks
        return replace(self, shape=tuple(shape))

    def describe(self) -> str:
        """One line, the same in logs, errors and the handshake."""
        return (
            f"{self.name}[{self.layout.value} {self.dtype.value} {list(self.shape)}"
            f" block_len={self.block_len} stride={self.stride} {self.memory.value}]"
        )


@dataclass(frozen=True)
class KVCacheSpec:
    """A worker's whole KV cache: model fingerprint, groups and regions (in registration order)."""

    model: str
    groups: tuple[KVGroup, ...]
    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        if not self.model:
            raise SpecError("the spec has no model name", fix='set model = "..." in the spec')
        if not self.groups:
            raise SpecError("the spec has no KV cache groups", fix="declare at least one group")
        if not self.regions:
            raise SpecError("the spec has no regions", fix="declare at least one region")
        _unique([g.name for g in self.groups], "group")
        _unique([r.name for r in self.regions], "region")
        for r in self.regions:
            if not 0 <= r.group < len(self.groups):
                raise SpecError(
                    f"region {r.name!r} names group index {r.group}, but there are"
                    f" {len(self.groups)} groups",
                    fix="point every region at a declared group",
                )
            g = self.groups[r.group]
            if r.layout not in _KIND_LAYOUTS[g.kind]:
                allowed = ", ".join(sorted(x.value for x in _KIND_LAYOUTS[g.kind]))
                raise SpecError(
                    f"region {r.name!r} has layout {r.layout.value}, which a {g.kind.value}"
                    f" group cannot hold",
                    fix=f"use one of {allowed}",
                )
            tpb = r.tokens_per_block
            if tpb and tpb != g.kernel_block_size:
                raise SpecError(
                    f"region {r.name!r} holds {tpb} tokens per block but group {g.name!r} has"
                    f" kernel block size {g.kernel_block_size}",
                    fix="the region's block_size dim must equal the group's kernel_block_size",
                )
        for gi, g in enumerate(self.groups):
            counts = {r.num_blocks for r in self.regions if r.group == gi}
            if not counts:
                raise SpecError(
                    f"group {g.name!r} has no regions", fix="remove it or add its regions"
                )
            if len(counts) > 1:
                raise SpecError(
                    f"regions of group {g.name!r} disagree on the number of kernel blocks:"
                    f" {sorted(counts)}",
                    fix="every region of one group must have the same num_blocks",
                )

    def group_index(self, name: str) -> int:
        for i, g in enumerate(self.groups):
            if g.name == name:
                return i
        raise SpecError(
            f"no group named {name!r}; groups are {[g.name for g in self.groups]}",
            fix="use one of the declared group names",
        )

    @functools.cached_property
    def _by_group(self) -> dict[int, tuple[tuple[Region, ...], int, int]]:
        """Per group, derived once (the spec is immutable): regions, kernel and logical blocks."""
        by = [tuple(r for r in self.regions if r.group == g) for g in range(len(self.groups))]
        n = [rs[0].num_blocks for rs in by]
        return {g: (rs, n[g], n[g] // self.groups[g].ppl) for g, rs in enumerate(by)}

    @functools.cached_property
    def geometry_ids(self) -> tuple[int, ...]:
        """Per region: a small int, equal for equal group, layout, dtype, shape, block_stride."""
        ids: dict[tuple[object, ...], int] = {}
        keys = [(r.group, r.layout, r.dtype, r.shape, r.block_stride) for r in self.regions]
        return tuple(ids.setdefault(k, len(ids)) for k in keys)

    @functools.cached_property
    def pairing(self) -> tuple[int, tuple[tuple[str, int], ...]]:
        """What regions pair on between peers: the group count, each region's name and group."""
        return len(self.groups), tuple((r.name, r.group) for r in self.regions)

    def _group(self, group: int) -> tuple[tuple[Region, ...], int, int]:
        if (found := self._by_group.get(group)) is None:  # IndexError, as regions_of(g)[0] did
            raise IndexError(f"no KV cache group {group!r}")
        return found

    def regions_of(self, group: int) -> tuple[Region, ...]:
        return self._by_group.get(group, ((),))[0]

    def num_kernel_blocks(self, group: int) -> int:
        """Registered kernel blocks of a group (all its regions agree)."""
        return self._group(group)[1]

    def num_logical_blocks(self, group: int) -> int:
        return self._group(group)[2]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.regions)

    def with_memory(self, memory: MemoryType) -> KVCacheSpec:
        regions = tuple(replace(r, memory=memory) for r in self.regions)
        return KVCacheSpec(self.model, self.groups, regions)

    def to_dict(self) -> dict[str, Any]:
        """Plain data, the source of the TOML file and of digests."""
        return {
            "model": self.model,
            "groups": [{**asdict(g), "kind": g.kind.value} for g in self.groups],
            "regions": [
                {
                    "name": r.name,
                    "group": self.groups[r.group].name,
                    "dtype": r.dtype.value,
                    "layout": r.layout.value,
                    "shape": list(r.shape),
                    "memory": r.memory.value,
                    **({"block_stride": r.block_stride} if r.block_stride else {}),
                }
                for r in self.regions
            ],
        }

    def digest(self) -> str:
        """SHA-256 of everything in the spec (canonical JSON)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def describe(self) -> str:
        gs = ", ".join(
            f"{g.name}({g.kind.value} logical={g.logical_block_size} kernel="
            f"{g.kernel_block_size} ppl={g.ppl})"
            for g in self.groups
        )
        return f"{self.model}: {len(self.regions)} regions, {self.nbytes} bytes; groups {gs}"


def _unique(names: Sequence[str], what: str) -> None:
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise SpecError(
                f"{what} name {n!r} is used twice", fix=f"give every {what} a unique name"
            )
        seen.add(n)
