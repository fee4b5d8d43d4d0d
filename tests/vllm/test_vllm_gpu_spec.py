"""The GPU path's description of vLLM's KV tensors, on CPU tensors shaped and strided the way
a GPU worker hands them to the connector (no vLLM, no CUDA):

* vLLM 0.32's ``[B, H, N, C]`` layer views of one flat allocation (what every backend gets,
  FlashAttention included), in layer-compact and block-outermost layouts;
* backend tensors shaped by ``get_kv_cache_shape``: FlashAttention K/V outermost
  ``(2, B, N, H, D)`` in both stride orders, FlashInfer/Triton blocks-first ``(B, 2, N, H, D)``
  and MLA ``(B, N, L)``.

Each description must pass the daemon's own tensor check (``KVPool.from_tensors``) and alias
vLLM's memory block for block: the bytes a region's block holds are the bytes vLLM's tensor
holds for that block, and writing one is seen through the other.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvxferd.errors import SpecError
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import Layout, MemoryType
from kvxferd.pool import KVPool
from kvxferd.vllm.gpu import check_exportable
from kvxferd.vllm.spec import kernel_block_sizes
from kvxferd.vllm.tensors import DescribedKv, describe
from tests.vllm.test_vllm_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
)

NB, N, H, D = 8, 16, 4, 32
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
ATTN = FullAttentionSpec(N, H, D, torch.bfloat16)
PAGE = ATTN.page_size_bytes
_ORDER = {  # vLLM's KVCacheLayout: physical order of [L, B, H, N, C]
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
}


def _config(layout: str, tensor: KVCacheTensor, spec: Any = ATTN) -> KVCacheConfig:
    return KVCacheConfig(NB, [tensor], [KVCacheGroupSpec(list(tensor.layers), spec)], layout)


def vllm_views(layout: str) -> tuple[KVCacheConfig, torch.Tensor, dict[str, torch.Tensor]]:
    """What vLLM 0.32's worker builds: one int8 allocation (rounded up to 4 KiB) and per layer
    a bf16 ``[B, H, N, 2 * D]`` view strided in the layout's order (create_kv_cache_views)."""
    order = _ORDER[layout]
    shape = (len(LAYERS), NB, H, N, 2 * D)  # elements
    strides = [0] * 5
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    es = 2
    tensor = KVCacheTensor(step * es, LAYERS, strides[0] * es, strides[1] * es)
    raw = torch.randint(-128, 127, ((step * es + 4095) // 4096 * 4096,), dtype=torch.int8)
    full = raw.view(torch.bfloat16).as_strided(shape, strides)
    return _config(layout, tensor), raw, {name: full[i] for i, name in enumerate(LAYERS)}


def _block_bytes(t: torch.Tensor, b: int) -> torch.Tensor:
    return t[b].contiguous().view(torch.uint8).reshape(-1).sort().values


def _aliases(d: DescribedKv, name: str, theirs: torch.Tensor, b: int) -> None:
    """Region ``name``'s block ``b`` holds ``theirs`` (vLLM's block) and is the same memory."""
    ours = d.tensors[name]
    assert torch.equal(
        _block_bytes(ours, b), theirs.contiguous().view(torch.uint8).reshape(-1).sort().values
    )
    ours[b].view(torch.uint8).fill_(0x5A)  # write through the description ...
    assert bool((theirs.view(torch.uint8) == 0x5A).all())  # ... vLLM sees it


# ---- vLLM 0.32 layer views ---------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(_ORDER))
def test_layer_views_of_one_allocation_in_every_blocks_first_layout(layout: str) -> None:
    cfg, raw, views = vllm_views(layout)
    d = describe(cfg, views, model="m", backend="FLASH_ATTN")
    s = d.spec
    assert {r.memory for r in s.regions} == {MemoryType.VRAM}
    assert [r.name for r in s.regions] == LAYERS
    want = Layout.HND if layout[2:4] == "HN" else Layout.NHD
    assert {r.layout for r in s.regions} == {want}
    assert s.regions[0].block_len == PAGE
    assert s.regions[0].stride == (PAGE if layout.startswith("L") else 2 * PAGE)
    assert s.model == f"m [vllm-kv layout={layout} backend=FLASH_ATTN tp=1]"
    KVPool.from_tensors(s, d.tensors)  # what the daemon runs on an IMPORTED attach
    for name, v in views.items():
        assert d.tensors[name].untyped_storage().data_ptr() == raw.data_ptr()
        assert d.tensors[name][3].data_ptr() == v[3].data_ptr()
        _aliases(d, name, v[5], 5)


def test_kernel_blocks_smaller_than_the_manager_block_come_from_the_views() -> None:
    """vLLM splits each 32-token block into two 16-token kernel blocks: its views have 2 x
    num_blocks blocks, and the kernel block size is read off them."""
    spec = FullAttentionSpec(2 * N, H, D, torch.bfloat16)
    page, kernel_page = spec.page_size_bytes, PAGE
    tensor = KVCacheTensor(page * NB * 2, LAYERS, page * NB, page)
    cfg = _config("LBHNC", tensor, spec)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    typed = raw.view(torch.bfloat16)
    views = {
        name: typed.as_strided(
            (2 * NB, H, N, 2 * D), (kernel_page // 2, N * 2 * D, 2 * D, 1), i * page * NB // 2
        )
        for i, name in enumerate(LAYERS)
    }
    assert kernel_block_sizes(cfg, views) == [N]
    d = describe(cfg, views, model="m", kernel_block_sizes=kernel_block_sizes(cfg, views))
    g = d.spec.groups[0]
    assert (g.logical_block_size, g.kernel_block_size, d.spec.regions[0].num_blocks) == (
        2 * N,
        N,
        2 * NB,
    )
    KVPool.from_tensors(d.spec, d.tensors)


def _fp8_views() -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """An fp8 cache as vLLM hands it over: a uint8 spec and uint8 ``[B, H, N, C]`` views."""
    spec = FullAttentionSpec(N, H, D, torch.uint8)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(page * NB * len(LAYERS), LAYERS, page * NB, page)
    raw = torch.randint(0, 255, (tensor.size,), dtype=torch.uint8)
    views = {
        name: raw[i * page * NB : (i + 1) * page * NB].view(NB, H, N, 2 * D)
        for i, name in enumerate(LAYERS)
    }
    return _config("LBHNC", tensor, spec), views


def test_fp8_layer_views_are_described_in_the_configured_fp8_format() -> None:
    cfg, views = _fp8_views()
    d = describe(cfg, views, model="m", cache_dtype="fp8_e5m2")
    assert {(r.dtype, r.block_len) for r in d.spec.regions} == {(KVDType.FP8_E5M2, PAGE // 2)}
    assert {t.dtype for t in d.tensors.values()} == {torch.float8_e5m2}
    KVPool.from_tensors(d.spec, d.tensors)
    for name, v in views.items():
        _aliases(d, name, v[3], 3)


def test_fp8_layer_views_without_an_fp8_cache_dtype_are_refused() -> None:
    cfg, views = _fp8_views()
    with pytest.raises(SpecError, match=r"torch\.uint8 with cache_dtype 'auto'"):
        describe(cfg, views, model="m")


def test_a_view_that_contradicts_the_layout_is_refused() -> None:
    cfg, _, views = vllm_views("LBNHC")  # token-major views ...
    with pytest.raises(SpecError, match="token-major inside a block") as ei:
        describe(cfg, views, model="m", layout="LBHNC")  # ... described as head-major
    assert "docs/vllm.md" in str(ei.value)


def test_views_of_two_allocations_are_refused() -> None:
    cfg, _, views = vllm_views("LBHNC")
    views[LAYERS[1]] = views[LAYERS[1]].clone()
    with pytest.raises(SpecError, match="not in the allocation of the other layers"):
        describe(cfg, views, model="m")


def test_a_missing_layer_is_refused() -> None:
    cfg, _, views = vllm_views("LBHNC")
    del views[LAYERS[0]]
    with pytest.raises(SpecError, match="no KV cache tensor for layer"):
        describe(cfg, views, model="m")


# ---- backend tensors -----------------------------------------------------------------------


class FlashAttentionBackend:
    """Stand-in with FlashAttention's get_kv_cache_shape and get_kv_cache_stride_order."""

    layout = "NHD"

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_kv_cache_shape(
        nb: int, bs: int, heads: int, hs: int, dt: str = "auto"
    ) -> tuple[int, ...]:
        return (2, nb, bs, heads, hs)

    @classmethod
    def get_kv_cache_stride_order(cls) -> tuple[int, ...]:
        return (0, 1, 2, 3, 4) if cls.layout == "NHD" else (0, 1, 3, 2, 4)


class FlashAttentionHND(FlashAttentionBackend):
    layout = "HND"


class FlashInferBackend:
    @staticmethod
    def get_kv_cache_shape(
        nb: int, bs: int, heads: int, hs: int, dt: str = "auto"
    ) -> tuple[int, ...]:
        return (nb, 2, bs, heads, hs)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        return (0, 1, 3, 2, 4)  # HND


def _backend_tensor(shape: tuple[int, ...], order: tuple[int, ...]) -> torch.Tensor:
    """vLLM's pre-0.29 allocation: the shape permuted by the stride order, then viewed back."""
    physical = [shape[i] for i in order]
    inv = [order.index(i) for i in range(len(order))]
    return torch.randn(physical).to(torch.bfloat16).permute(*inv)


def _attn_config(spec: Any = ATTN) -> KVCacheConfig:
    tensors = [KVCacheTensor(spec.page_size_bytes * NB, [n], 0, 0) for n in LAYERS]
    return KVCacheConfig(NB, tensors, [KVCacheGroupSpec(LAYERS, spec)], None)


@pytest.mark.parametrize(
    ("backend", "lay"), [(FlashAttentionBackend, Layout.NHD), (FlashAttentionHND, Layout.HND)]
)
def test_flash_attention_kv_outermost_is_a_region_per_layer_and_half(
    backend: Any, lay: Layout
) -> None:
    order = backend.get_kv_cache_stride_order()
    kv = {n: _backend_tensor((2, NB, N, H, D), order) for n in LAYERS}
    d = describe(_attn_config(), kv, model="m", backend="FLASH_ATTN", backend_cls=backend)
    names = [f"{n}:{half}" for n in LAYERS for half in "kv"]
    assert [r.name for r in d.spec.regions] == names
    assert {(r.layout, r.shape) for r in d.spec.regions} == {(lay, (NB, 2, N, H, D // 2))}
    assert d.spec.regions[0].block_len == N * H * D * 2  # one half of a block, bf16
    assert d.spec.model == f"m [vllm-kv tensors=kv-outer-{lay.value} backend=FLASH_ATTN tp=1]"
    KVPool.from_tensors(d.spec, d.tensors)
    for n in LAYERS:
        for i, half in enumerate("kv"):
            _aliases(d, f"{n}:{half}", kv[n][i, 6], 6)


def test_flashinfer_blocks_first_is_one_exact_region_per_layer() -> None:
    kv = {n: _backend_tensor((NB, 2, N, H, D), (0, 1, 3, 2, 4)) for n in LAYERS}
    d = describe(_attn_config(), kv, model="m", backend="FLASHINFER", backend_cls=FlashInferBackend)
    assert [(r.name, r.layout, r.shape) for r in d.spec.regions] == [
        (n, Layout.HND, (NB, 2, N, H, D)) for n in LAYERS
    ]
    KVPool.from_tensors(d.spec, d.tensors)
    for n in LAYERS:
        _aliases(d, n, kv[n][2], 2)
        # exact: region element [b, kv, token, head, dim] is vLLM's
        assert torch.equal(d.tensors[n][4, 1, 3, 2], kv[n][4, 1, 3, 2])


def test_mla_latent_tensor_is_one_mla_region_per_layer() -> None:
    spec = MLAAttentionSpec(N, 1, 576, torch.bfloat16, head_size_v=0)
    kv = {n: torch.randn(NB, N, 576).to(torch.bfloat16) for n in LAYERS}
    d = describe(_attn_config(spec), kv, model="ds", backend="FLASHMLA")
    assert {(r.layout, r.shape) for r in d.spec.regions} == {(Layout.MLA, (NB, N, 576))}
    assert d.spec.model == "ds [vllm-kv tensors=mla backend=FLASHMLA tp=1]"
    KVPool.from_tensors(d.spec, d.tensors)
    _aliases(d, LAYERS[1], kv[LAYERS[1]][7], 7)


def test_a_tensor_against_its_backends_stride_order_is_refused() -> None:
    kv = {n: _backend_tensor((2, NB, N, H, D), (0, 1, 3, 2, 4)) for n in LAYERS}  # HND bytes
    with pytest.raises(SpecError, match="get_kv_cache_stride_order says") as ei:
        describe(_attn_config(), kv, model="m", backend_cls=FlashAttentionBackend)  # says NHD
    assert "docs/vllm.md" in str(ei.value)


def test_a_shape_kvxferd_cannot_describe_is_refused_with_the_shapes_it_knows() -> None:
    kv = {n: torch.zeros(NB, N, 2, H, D, dtype=torch.bfloat16) for n in LAYERS}
    with pytest.raises(SpecError, match=r"neither a \[B, H, N, C\] layer view"):
        describe(_attn_config(), kv, model="m")


def test_fingerprints_keep_tensor_forms_apart() -> None:
    views = describe(*vllm_views("LBNHC")[::2], model="m").spec.model
    kv = {n: _backend_tensor((2, NB, N, H, D), (0, 1, 2, 3, 4)) for n in LAYERS}
    outer = describe(_attn_config(), kv, model="m").spec.model
    assert views != outer


# ---- what cannot be exported -----------------------------------------------------------------


@pytest.mark.parametrize("key", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_expandable_segments_are_refused_with_the_fix(key: str) -> None:
    with pytest.raises(SpecError, match="expandable segments") as ei:
        check_exportable({key: "max_split_size_mb:512, expandable_segments:True"})
    assert f"unset expandable_segments in {key}" in str(ei.value)
    assert "docs/vllm.md" in str(ei.value)
    check_exportable({key: "expandable_segments:False"})
