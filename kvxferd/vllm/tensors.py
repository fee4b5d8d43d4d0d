"""The KV tensors a vLLM worker registered, described as a kvxferd spec over their own memory.

Pure: reads tensors' shapes, strides and storages (CPU tensors in tests, CUDA tensors on a GPU
worker), never vLLM and never the CUDA driver. Two forms are understood:

* **Layer views** (what vLLM 0.32 hands every connector, on GPU as on CPU, whatever the
  attention backend): one flat int8 allocation viewed per layer as ``[B, H, N, C]`` in the
  order the resolved ``KVCacheLayout`` names (vLLM's ``create_kv_cache_views``). The spec is
  :func:`kvxferd.vllm.spec.translate`'s, and every view is checked against it by its real
  start, block count, block stride and page interior.
* **Backend tensors**, shaped by the attention backend's ``get_kv_cache_shape`` (and ordered
  by its ``get_kv_cache_stride_order``): K/V outermost ``(2, B, N, H, D)`` (FlashAttention's
  shape), blocks-first ``(B, 2, N, H, D)`` (FlashInfer, Triton) and MLA ``(B, N, L)``. Each
  is described from its own strides: blocks-first and MLA are one region per layer, exactly
  kvxferd's layouts; K/V outermost is one region per layer and half (``<layer>:k``,
  ``<layer>:v``), each declared as a ``(B, 2, N, H, D/2)`` attention region (the half's block
  is one contiguous run of the same bytes; the page format in the fingerprint keeps such pools
  paired only with one another, as for vLLM's packed pages, docs/vllm.md).

Every refusal says what does not fit and points at docs/vllm.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvxferd.errors import SpecError
from kvxferd.layout.spec import GroupKind, KVCacheSpec, Layout, MemoryType, Region
from kvxferd.vllm.kinds import DOC, layer_spec
from kvxferd.vllm.spec import _region, groups_of, region_strides, translate


@dataclass(frozen=True)
class DescribedKv:
    """A spec and, per region, a tensor over vLLM's memory shaped and strided as it says."""

    spec: KVCacheSpec
    tensors: dict[str, torch.Tensor]
    page_format: str
    device: torch.device
    tp_rank: int = 0  # the worker's TP position (the Attach's tp_rank / tp_size)
    tp_size: int = 1


def describe(
    kv_cache_config: Any,
    kv_caches: Mapping[str, torch.Tensor],
    *,
    model: str,
    layout: Any = None,
    kernel_block_sizes: list[int] | None = None,
    backend: str = "",
    backend_cls: Any = None,
    tp_size: int = 1,
    memory: MemoryType = MemoryType.VRAM,
    cache_dtype: str = "auto",
    tp_rank: int = 0,
) -> DescribedKv:
    """Describe ``kv_caches`` (vLLM's ``register_kv_caches`` argument) as a kvxferd spec.

    ``backend_cls``: the attention backend class, when known: its ``get_kv_cache_shape`` and
    ``get_kv_cache_stride_order`` confirm which dim of a backend tensor is which;
    ``cache_dtype``: vLLM's ``cache_config.cache_dtype`` (the fp8 format of a uint8 cache);
    ``tp_rank`` / ``tp_size``: the worker's TP position (as :func:`~kvxferd.vllm.spec.translate`
    says, the regions hold the rank's own heads, the TP size goes into the page format)."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise SpecError(
            f"TP rank {tp_rank} is not in [0, tp_size={tp_size})",
            fix=f"pass the worker's tensor-parallel rank and size (see {DOC})",
        )
    _, _, by_layer = groups_of(kv_cache_config, kernel_block_sizes)
    layers = list(by_layer)
    missing = [n for n in by_layer if n not in kv_caches]
    if missing:
        raise SpecError(
            f"vLLM registered no KV cache tensor for layer {missing[0]!r}",
            fix=f"this vLLM version places layers differently; see {DOC}",
        )
    devices = {kv_caches[n].device for n in layers}
    if len(devices) != 1:
        raise SpecError(
            f"vLLM's KV cache tensors sit on {len(devices)} devices: {sorted(map(str, devices))}",
            fix=f"one connector attaches one worker's cache on one device (see {DOC})",
        )
    o = _Opts(model, layout, kernel_block_sizes, backend, backend_cls, tp_size, memory, cache_dtype)
    if {kv_caches[n].dim() for n in layers} == {4}:
        out = _from_views(kv_cache_config, kv_caches, o)
    else:
        out = _from_backend(kv_cache_config, kv_caches, o)
    return DescribedKv(out[0], out[1], out[2], next(iter(devices)), tp_rank, tp_size)


@dataclass(frozen=True)
class _Opts:
    model: str
    layout: Any
    kernel_block_sizes: list[int] | None
    backend: str
    backend_cls: Any
    tp_size: int
    memory: MemoryType
    cache_dtype: str  # vLLM's cache_config.cache_dtype: the fp8 format of a uint8 cache


def over(base: torch.Tensor, region: Region, offset: int) -> torch.Tensor:
    """A tensor over ``base``'s storage, ``offset`` bytes in, shaped and strided as ``region``
    (bounds checked: the region must lie inside the storage)."""
    storage = base.untyped_storage()
    item = region.dtype.itemsize
    if offset < 0 or offset % item or offset + region.nbytes > storage.nbytes():
        raise SpecError(
            f"region {region.name!r}: {region.nbytes} bytes from byte {offset} do not fit"
            f" {region.dtype.value}-aligned in vLLM's {storage.nbytes()}-byte allocation",
            fix=f"this vLLM version places layers differently; see {DOC}",
        )
    dtype = getattr(torch, region.dtype.torch_name)
    t = torch.empty(0, dtype=dtype, device=base.device)
    return t.set_(storage, offset // item, region.shape, region_strides(region))


def _interior(t: torch.Tensor, first: int) -> tuple[int, list[int]]:
    """Bytes of one block (dims ``first:`` of ``t``) if they are one dense run, else -1; and
    those dims from outermost to innermost in memory (size-1 dims left out)."""
    dims = [d for d in range(first, t.dim()) if t.shape[d] > 1]
    dims.sort(key=lambda d: -int(t.stride()[d]))
    step = 1
    for d in reversed(dims):
        if t.stride(d) != step:
            return -1, dims
        step *= t.shape[d]
    return step * t.element_size(), dims


def _mismatch(layer: str, what: str) -> SpecError:
    return SpecError(
        f"vLLM's KV cache tensor of layer {layer!r} {what}",
        fix=f"this vLLM version or attention backend lays the cache out differently than"
        f" kvxferd can describe; see {DOC}",
    )


def _from_views(
    kcfg: Any, views: Mapping[str, torch.Tensor], o: _Opts
) -> tuple[KVCacheSpec, dict[str, torch.Tensor], str]:
    tr = translate(
        kcfg,
        model=o.model,
        layout=o.layout,
        kernel_block_sizes=o.kernel_block_sizes,
        backend=o.backend,
        tp_size=o.tp_size,
        memory=o.memory,
        cache_dtype=o.cache_dtype,
    )
    first = views[tr.placements[0].region]
    base = first.untyped_storage().data_ptr()
    tensors = {}
    for r, p in zip(tr.spec.regions, tr.placements, strict=True):
        v = views[p.region]
        if v.untyped_storage().data_ptr() != base:
            raise _mismatch(p.region, "is not in the allocation of the other layers")
        es = v.element_size()
        start = v.data_ptr() - base
        if start != p.offset:
            raise _mismatch(
                p.region, f"starts {start} bytes in; the translation expected {p.offset}"
            )
        if int(v.shape[0]) != r.num_blocks or v.stride(0) * es != r.stride:
            raise _mismatch(
                p.region,
                f"has {v.shape[0]} blocks {v.stride(0) * es} bytes apart; the translation"
                f" expected {r.num_blocks} blocks {r.stride} bytes apart",
            )
        nbytes, order = _interior(v, 1)
        if nbytes != r.block_len:
            raise _mismatch(
                p.region,
                f"does not keep a block's {r.block_len} bytes as one dense run"
                f" (shape {tuple(v.shape)}, strides {tuple(v.stride())})",
            )
        if r.layout.has_kv_halves and {1, 2} <= set(order):
            head_major = order.index(1) < order.index(2)
            if head_major != r.layout.head_major:
                raise _mismatch(
                    p.region,
                    f"is {'head' if head_major else 'token'}-major inside a block, but the"
                    f" layout {tr.page_format.split()[1]} says otherwise",
                )
        tensors[r.name] = over(v, r, p.offset)
    return tr.spec, tensors, tr.page_format


def _from_backend(
    kcfg: Any, kv: Mapping[str, torch.Tensor], o: _Opts
) -> tuple[KVCacheSpec, dict[str, torch.Tensor], str]:
    _, kv_groups, by_layer = groups_of(kcfg, o.kernel_block_sizes)
    groups = list(kcfg.kv_cache_groups)
    num_blocks = int(kcfg.num_blocks)
    regions: list[Region] = []
    tensors: dict[str, torch.Tensor] = {}
    forms: set[str] = set()
    for layer, (gi, vgid, g) in by_layer.items():
        if g.kind is GroupKind.MAMBA:
            raise _mismatch(layer, "is a Mamba state outside vLLM's [B, H, N, C] layer views")
        canon, _ = _region(
            layer,
            gi,
            g.kind,
            layer_spec(groups[vgid].kv_cache_spec, layer),
            layout=Layout.NHD,
            kernel=g.kernel,
            nblocks=num_blocks * (g.logical // g.kernel),
            cache_dtype=o.cache_dtype,
        )
        t = kv[layer]
        if t.element_size() != canon.dtype.itemsize:
            raise _mismatch(layer, f"holds {t.dtype}; the KV cache spec says {canon.dtype}")
        _check_backend_shape(layer, t, o.backend_cls, canon)
        for form, region, base in _backend_regions(layer, t, canon):
            forms.add(form)
            regions.append(region)
            tensors[region.name] = over(base, region, base.data_ptr() - _storage_ptr(base))
    if len(forms) != 1:
        raise SpecError(
            f"vLLM's KV cache tensors mix forms {sorted(forms)}",
            fix=f"see {DOC} for the tensor forms kvxferd describes",
        )
    page_format = f"vllm-kv tensors={forms.pop()} backend={o.backend or 'unknown'} tp={o.tp_size}"
    spec = KVCacheSpec(f"{o.model} [{page_format}]", tuple(kv_groups), tuple(regions))
    spec = spec.with_memory(o.memory)
    return spec, {r.name: tensors[r.name] for r in spec.regions}, page_format


def _storage_ptr(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def _check_backend_shape(layer: str, t: torch.Tensor, backend_cls: Any, canon: Region) -> None:
    """Where the backend says its shape and stride order, the tensor must match them."""
    if backend_cls is None or not canon.layout.has_kv_halves:
        return
    nb, _, n, h, d = canon.shape
    want = _ask(backend_cls, "get_kv_cache_shape", nb, n, h, d)
    if want is not None and want != tuple(t.shape):
        raise _mismatch(
            layer, f"is shaped {tuple(t.shape)}; its backend's get_kv_cache_shape says {want}"
        )
    order = _ask(backend_cls, "get_kv_cache_stride_order")
    if order is not None:
        got = sorted(range(t.dim()), key=lambda i: -int(t.stride()[i]))
        real = [i for i in got if t.shape[i] > 1]
        if real != [i for i in order if t.shape[i] > 1]:
            raise _mismatch(
                layer,
                f"has strides {tuple(t.stride())}; its backend's"
                f" get_kv_cache_stride_order says {order}",
            )


def _ask(backend_cls: Any, method: str, *args: int) -> tuple[int, ...] | None:
    """``backend_cls.method(*args)`` as a tuple of ints; None where the backend has no such
    method or it cannot answer outside a running engine (the tensor's own geometry still
    decides)."""
    fn = getattr(backend_cls, method, None)
    if fn is None:
        return None
    try:
        return tuple(int(x) for x in fn(*args))
    except Exception:
        return None


def _backend_regions(
    layer: str, t: torch.Tensor, canon: Region
) -> list[tuple[str, Region, torch.Tensor]]:
    """(form, region, tensor whose first element is the region's block 0) per region."""
    if canon.layout is Layout.MLA:
        if tuple(t.shape) != canon.shape:
            raise _mismatch(layer, f"is shaped {tuple(t.shape)}; MLA needs {canon.shape}")
        return [("mla", _strided(layer, t, canon, canon.layout), t)]
    nb, _, n, h, d = canon.shape
    if (
        t.dim() == 5
        and tuple(t.shape) == (nb, 2, n, h, d)
        and (nb != 2 or t.stride(0) > t.stride(1))
    ):
        nbytes, order = _interior(t, 1)
        if nbytes != canon.block_len or (order and order[0] != 1):
            raise _mismatch(
                layer,
                f"does not keep a block's K then V as one dense run (strides {tuple(t.stride())})",
            )
        lay = _major(order, heads=3, tokens=2)
        return [(f"blocks-first-{lay.value}", _strided(layer, t, canon, lay), t)]
    if t.dim() == 5 and tuple(t.shape) == (2, nb, n, h, d):
        if d % 2:
            raise _mismatch(layer, f"keeps K and V outermost with an odd head size {d}")
        half = Region(f"{layer}:k", canon.group, canon.dtype, Layout.NHD, (nb, 2, n, h, d // 2))
        out = []
        for i, name in enumerate((f"{layer}:k", f"{layer}:v")):
            part = t[i]
            nbytes, order = _interior(part, 1)
            if nbytes != half.block_len:
                raise _mismatch(
                    layer,
                    f"does not keep a block of its {'KV'[i]} half as one"
                    f" dense run (strides {tuple(t.stride())})",
                )
            lay = _major(order, heads=2, tokens=1)
            region = Region(name, half.group, half.dtype, lay, half.shape)
            out.append((f"kv-outer-{lay.value}", _strided(name, part, region, lay), part))
        return out
    raise _mismatch(
        layer,
        f"is shaped {tuple(t.shape)}: neither a [B, H, N, C] layer view, nor (2, {nb}, {n},"
        f" {h}, {d}) K/V outermost, nor ({nb}, 2, {n}, {h}, {d}) blocks-first",
    )


def _major(order: list[int], *, heads: int, tokens: int) -> Layout:
    """HND when heads sit outside tokens in memory (both dims > 1), else NHD."""
    if heads in order and tokens in order and order.index(heads) < order.index(tokens):
        return Layout.HND
    return Layout.NHD


def _strided(name: str, t: torch.Tensor, like: Region, lay: Layout) -> Region:
    """``like`` as region ``name`` with layout ``lay`` and ``t``'s block stride."""
    stride = t.stride(0) * t.element_size()
    base = Region(name, like.group, like.dtype, lay, like.shape)
    if stride < base.block_len:
        raise _mismatch(
            name, f"has blocks {stride} bytes apart, less than a block's {base.block_len} bytes"
        )
    return Region(
        name,
        like.group,
        like.dtype,
        lay,
        like.shape,
        MemoryType.DRAM,
        0 if stride == base.block_len else stride,
    )


__all__ = ["DescribedKv", "describe", "over"]
