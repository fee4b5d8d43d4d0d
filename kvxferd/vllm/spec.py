"""vLLM's ``KVCacheConfig`` -> a kvxferd :class:`~kvxferd.layout.spec.KVCacheSpec` (pure).

vLLM (0.32) allocates one flat backing buffer and places every layer's pages in it: layer
``l`` of a :class:`KVCacheTensor`, manager block ``b``, starts at ``offset + l * layer_stride
+ b * block_stride`` bytes. Each layer's page is viewed as ``[B, H, N, C]`` (blocks, head
slots, tokens, content bytes; attention content is K then V of one head) in the physical order
the resolved ``KVCacheLayout`` names (``LBHNC``, ``LBNHC``, ``BLHNC``, ...).

This module reads that geometry from the config alone (no tensors, no vLLM import: the
objects are read by attribute and by class name, so tests pass stand-ins) and describes it the
way kvxferd does (docs/spec.md): one region per layer, blocks-first, its kernel blocks
``block_len`` contiguous bytes ``block_stride`` apart, a group per vLLM transfer group with its
logical (manager) and kernel block sizes. :class:`RegionPlacement` keeps, per region, where its
block 0 sits in the backing buffer, so the worker can hand the daemon the same bytes vLLM
computes into.

What kvxferd's layout vocabulary cannot say exactly: vLLM 0.32 packs K and V inside each
(head, token) cell (``C``), while kvxferd's attention layouts put K and V halves outside the
heads. A whole block is the same bytes either way, so pulls between two vLLM workers of the
same page format move the right bytes; what would go wrong is slicing heads for a different TP
size. The spec therefore declares ``HND`` when vLLM's page is head-major and ``NHD`` when it is
token-major, and puts vLLM's exact page format (layout, attention backend, TP size) in the
model fingerprint, which peers must match (docs/domain.md §7): a peer with another page format
or TP size is refused at the handshake with both values named. docs/vllm.md says more.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvxferd.errors import SpecError
from kvxferd.layout.spec import GroupKind, KVCacheSpec, KVGroup, Layout, MemoryType, Region
from kvxferd.vllm.kinds import (
    DOC,
    check_plain_attention,
    group_kind,
    kv_dtype,
    layer_spec,
    layout_name,
    page_layout,
)


@dataclass(frozen=True)
class RegionPlacement:
    """Where one region (one vLLM layer) sits in vLLM's backing buffer."""

    region: str  # kvxferd region name == vLLM layer name
    group: int  # kvxferd group index
    vllm_group: int  # index into kv_cache_config.kv_cache_groups
    offset: int  # bytes from the buffer's start to kernel block 0
    block_stride: int  # bytes between consecutive kernel blocks
    num_blocks: int  # kernel blocks


@dataclass(frozen=True)
class VllmKvSpec:
    """The translation: the kvxferd spec plus where each region lives in vLLM's buffer."""

    spec: KVCacheSpec
    placements: tuple[RegionPlacement, ...]
    vllm_group_ids: tuple[int, ...]  # vLLM group index of each kvxferd group
    buffer_size: int  # bytes of vLLM's backing allocation
    page_format: str  # what the fingerprint says about vLLM's page interior
    tp_rank: int = 0  # this worker's TP position (the Attach's tp_rank / tp_size)
    tp_size: int = 1

    def placement(self, region: str) -> RegionPlacement:
        for p in self.placements:
            if p.region == region:
                return p
        raise KeyError(region)


@dataclass(frozen=True)
class _Group:
    kind: GroupKind
    logical: int
    kernel: int


def _group(kv_group: Any, vllm_gid: int, kernel_block_size: int | None) -> _Group:
    spec = kv_group.kv_cache_spec
    first = layer_spec(spec, kv_group.layer_names[0]) if kv_group.layer_names else spec
    where = f"vLLM KV cache group {vllm_gid}"
    kind = group_kind(first, where)
    logical = int(spec.block_size)
    if kind is GroupKind.MAMBA:
        return _Group(kind, logical, logical)
    kernel = int(kernel_block_size or logical)
    if kernel <= 0 or logical % kernel:
        raise SpecError(
            f"{where}: kernel block size {kernel} does not divide the block size {logical}",
            fix="pass the kernel block sizes the model runner chose (one per KV cache group)",
        )
    return _Group(kind, logical, kernel)


def _region(
    name: str,
    gi: int,
    kind: GroupKind,
    spec: Any,
    *,
    layout: Layout,
    kernel: int,
    nblocks: int,
    cache_dtype: str = "auto",
) -> tuple[Region, int]:
    """The region of one layer and its kernel block's byte length (``cache_dtype``: vLLM's
    ``cache_config.cache_dtype``, naming the fp8 format of a ``torch.uint8`` cache)."""
    where = f"vLLM layer {name!r}"
    if kind is GroupKind.MAMBA:
        dtypes = [kv_dtype(d, where) for d in spec.dtypes]
        dtype = min(dtypes, key=lambda d: d.itemsize)
        content = int(spec.state_content_size_bytes)
        if content % dtype.itemsize:
            raise SpecError(
                f"{where}: a Mamba state of {content} bytes is not a whole number of"
                f" {dtype.value} elements",
                fix=f"see {DOC} for the supported Mamba state shapes",
            )
        shape: tuple[int, ...] = (nblocks, content // dtype.itemsize)
        return Region(name, gi, dtype, Layout.STATE, shape), content
    check_plain_attention(spec, where, mla=kind is GroupKind.MLA)
    dtype = kv_dtype(spec.dtype, where, cache_dtype)
    if kind is GroupKind.MLA:
        latent = int(spec.head_size) * int(getattr(spec, "num_kv_heads", 1) or 1)
        shape = (nblocks, kernel, latent)
        region = Region(name, gi, dtype, Layout.MLA, shape)
    else:
        heads = int(spec.num_kv_heads)
        shape = (nblocks, 2, kernel, heads, int(spec.head_size))
        # One head (or one token) per block: HND and NHD are the same bytes; kvxferd reads
        # such a tensor as NHD, so declare that.
        region = Region(name, gi, dtype, Layout.NHD if 1 in (heads, kernel) else layout, shape)
    return region, region.block_len


LayerGroups = dict[str, tuple[int, int, _Group]]  # layer -> (kvxferd gi, vLLM gid, group)


def groups_of(
    kv_cache_config: Any, kernel_block_sizes: Sequence[int] | None
) -> tuple[list[int], list[KVGroup], LayerGroups]:
    """vLLM's transferable groups (their indices), as kvxferd groups, and each layer's group."""
    groups = list(kv_cache_config.kv_cache_groups)
    transfer = [i for i, g in enumerate(groups) if getattr(g, "enable_kv_transfer", True)]
    if not transfer:
        raise SpecError(
            "vLLM's KV cache config has no transferable KV cache group",
            fix=f"check the model: kvxferd moves attention, MLA and Mamba caches (see {DOC})",
        )
    kbs = list(kernel_block_sizes) if kernel_block_sizes is not None else [None] * len(groups)
    if len(kbs) < len(groups):
        raise SpecError(
            f"{len(kbs)} kernel block sizes for {len(groups)} vLLM KV cache groups",
            fix="pass one kernel block size per KV cache group",
        )
    kv_groups: list[KVGroup] = []
    by_layer: LayerGroups = {}
    for gi, vgid in enumerate(transfer):
        g = _group(groups[vgid], vgid, kbs[vgid])
        name = f"{vgid}.{g.kind.value}"
        kv_groups.append(KVGroup(name, g.kind, g.logical, g.kernel))
        for layer in groups[vgid].layer_names:
            by_layer[layer] = (gi, vgid, g)
    return transfer, kv_groups, by_layer


def kernel_block_sizes(kv_cache_config: Any, kv_caches: Mapping[str, Any]) -> list[int]:
    """The kernel block size of each vLLM KV cache group, read off the layer tensors vLLM
    registered: a ``[B, H, N, C]`` view with more blocks than the config's ``num_blocks``
    splits each manager block into ``B // num_blocks`` kernel blocks."""
    out = []
    for g in kv_cache_config.kv_cache_groups:
        size = int(g.kv_cache_spec.block_size)
        t = next((kv_caches[n] for n in g.layer_names if n in kv_caches), None)
        nb = int(kv_cache_config.num_blocks)
        if t is not None and t.dim() == 4 and int(t.shape[0]) > nb > 0:
            size //= int(t.shape[0]) // nb
        out.append(size)
    return out


def translate(
    kv_cache_config: Any,
    *,
    model: str,
    layout: Any = None,
    kernel_block_sizes: Sequence[int] | None = None,
    backend: str = "",
    tp_size: int = 1,
    memory: MemoryType = MemoryType.DRAM,
    cache_dtype: str = "auto",
    tp_rank: int = 0,
) -> VllmKvSpec:
    """Translate vLLM's ``kv_cache_config`` (read by attribute) into a kvxferd spec.

    ``layout``: the resolved ``KVCacheLayout`` (or its name; default ``kv_cache_config.
    kv_cache_layout``); ``kernel_block_sizes``: one per vLLM KV cache group, as the model
    runner chose them (default: the groups' block sizes); ``backend``: the attention backend's
    name, part of the page format in the fingerprint; ``cache_dtype``: vLLM's
    ``cache_config.cache_dtype`` (``fp8``, ``fp8_e4m3`` and ``fp8_e5m2`` caches are
    ``torch.uint8`` in the spec; this names their element format).

    ``tp_rank`` / ``tp_size``: this worker's TP position. vLLM's spec already holds the
    per-rank KV heads (an MLA latent is whole on every rank), so the regions do not depend on
    the rank; the TP size is part of the page format in the fingerprint (peers of another TP
    size are refused at the handshake) and the position goes with the spec to the Attach."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise SpecError(
            f"TP rank {tp_rank} is not in [0, tp_size={tp_size})",
            fix=f"pass the worker's tensor-parallel rank and size (see {DOC})",
        )
    lay = layout_name(layout if layout is not None else kv_cache_config.kv_cache_layout)
    page, _ = page_layout(lay)
    groups = list(kv_cache_config.kv_cache_groups)
    transfer, kv_groups, by_layer = groups_of(kv_cache_config, kernel_block_sizes)
    num_blocks = int(kv_cache_config.num_blocks)
    regions: list[Region] = []
    placements: list[RegionPlacement] = []
    sizes = set()
    for t in kv_cache_config.kv_cache_tensors:
        sizes.add(int(t.size))
        for li, layer in enumerate(t.layers):
            if layer not in by_layer:
                continue  # a group that is not transferred
            gi, vgid, g = by_layer[layer]
            spec = layer_spec(groups[vgid].kv_cache_spec, layer)
            ratio = g.logical // g.kernel if not g.kind.is_state else 1
            region, block_len = _region(
                layer,
                gi,
                g.kind,
                spec,
                layout=page,
                kernel=g.kernel,
                nblocks=num_blocks * ratio,
                cache_dtype=cache_dtype,
            )
            stride = int(t.block_stride)
            if ratio > 1:
                if stride != block_len * ratio:
                    raise SpecError(
                        f"vLLM layer {layer!r}: manager blocks of {stride} bytes are not"
                        f" {ratio} dense kernel blocks of {block_len} bytes",
                        fix="use a layer-outermost KV cache layout (LBHNC or LBNHC) with"
                        f" kernel block splitting (see {DOC})",
                    )
                stride //= ratio
            if stride < block_len:
                raise SpecError(
                    f"vLLM layer {layer!r}: block stride {stride} is smaller than its"
                    f" {block_len}-byte page",
                    fix=f"check vLLM's kv_cache_tensors for this layer (see {DOC})",
                )
            if stride != block_len:
                region = Region(
                    region.name,
                    region.group,
                    region.dtype,
                    region.layout,
                    region.shape,
                    region.memory,
                    stride,
                )
            offset = int(t.offset) + li * int(t.layer_stride)
            if offset + region.nbytes > int(t.size):
                raise SpecError(
                    f"vLLM layer {layer!r}: {region.nbytes} bytes from offset {offset} run past"
                    f" the {t.size}-byte KV cache allocation",
                    fix=f"check vLLM's kv_cache_tensors for this layer (see {DOC})",
                )
            regions.append(region)
            placements.append(RegionPlacement(layer, gi, vgid, offset, stride, num_blocks * ratio))
    if not regions:
        raise SpecError(
            "vLLM's kv_cache_tensors place no layer of a transferable group",
            fix=f"see {DOC}",
        )
    if len(sizes) != 1:
        raise SpecError(
            f"vLLM's KV cache tensors name {len(sizes)} backing allocations; kvxferd expects one",
            fix=f"see {DOC}",
        )
    page_format = f"vllm-kv layout={lay} backend={backend or 'unknown'} tp={tp_size}"
    spec = KVCacheSpec(f"{model} [{page_format}]", tuple(kv_groups), tuple(regions))
    spec = spec.with_memory(memory)
    return VllmKvSpec(
        spec,
        tuple(placements),
        tuple(transfer),
        next(iter(sizes)),
        page_format,
        tp_rank,
        tp_size,
    )


def region_strides(region: Region) -> tuple[int, ...]:
    """Strides in elements of ``region``'s logical shape (its block stride included)."""
    order = region.stride_order
    strides = [0] * len(region.shape)
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= region.shape[d]
    bdim = region.layout.block_dim
    strides[bdim] = region.stride // region.dtype.itemsize
    if region.stride % region.dtype.itemsize:
        raise SpecError(
            f"region {region.name!r}: block stride {region.stride} is not a whole number of"
            f" {region.dtype.value} elements",
            fix=f"see {DOC}",
        )
    return tuple(strides)


def check_views(translated: VllmKvSpec, buffer_ptr: int, views: Mapping[str, int]) -> None:
    """Check the translation against vLLM's real per-layer views (``{layer: data_ptr}``):
    raises SpecError naming the first layer whose view does not start where the translation
    put it (a vLLM version whose placement rules differ)."""
    for p in translated.placements:
        ptr = views.get(p.region)
        if ptr is None:
            raise SpecError(
                f"vLLM registered no KV cache tensor for layer {p.region!r}",
                fix=f"this vLLM version places layers differently; see {DOC}",
            )
        if ptr - buffer_ptr != p.offset:
            raise SpecError(
                f"vLLM's view of layer {p.region!r} starts {ptr - buffer_ptr} bytes into the KV"
                f" cache; the translation expected {p.offset}",
                fix=f"this vLLM version places layers differently; see {DOC}",
            )


@dataclass(frozen=True)
class TransferGroup:
    """A vLLM KV cache group that kvxferd moves, as the scheduler side needs it."""

    vllm_group: int
    kind: GroupKind
    block_size: int


def transfer_groups(kv_cache_config: Any) -> tuple[TransferGroup, ...]:
    """vLLM's transferable groups, in kvxferd's group order (the order of the translation's
    groups and of every block-ID list the connector exchanges)."""
    out = []
    for gid, g in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(g, "enable_kv_transfer", True):
            continue
        grp = _group(g, gid, None)
        out.append(TransferGroup(gid, grp.kind, grp.logical))
    return tuple(out)
