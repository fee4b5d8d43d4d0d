"""vLLM ``KVCacheConfig`` -> kvxferd spec, without vLLM: stand-ins named like vLLM 0.32's
classes (the translation reads attributes and class names only). Dense, kernel block splitting,
sliding window + full attention, MLA, a Mamba hybrid with kernel block size != logical, and the
refusals; the regions' strides are checked against the daemon's own tensor check and against
vLLM-style ``[B, H, N, C]`` views of the same buffer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kvxferd.errors import SpecError
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import GroupKind, Layout
from kvxferd.pool import KVPool
from kvxferd.vllm.spec import check_views, region_strides, transfer_groups, translate
from kvxferd.wire.codec import spec_from_proto, spec_to_proto

# ---- stand-ins for vllm.v1.kv_cache_interface (same class and attribute names) ----------


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    head_size_v: int | None = None
    kv_quant_mode: int = 0
    page_size_padded: int | None = None
    num_head_slots: int | None = None
    state_content_bytes: int | None = None
    tokens_per_state: int = 1

    def __post_init__(self) -> None:
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    @property
    def page_size_bytes(self) -> int:
        hv = self.head_size_v or 0
        return self.block_size * self.num_kv_heads * (self.head_size + hv) * self.dtype.itemsize


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 128


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    pass


@dataclass(frozen=True)
class CrossAttentionSpec(FullAttentionSpec):
    pass


@dataclass(frozen=True)
class MambaSpec:
    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    page_size_padded: int | None = None

    @property
    def state_content_size_bytes(self) -> int:
        total = 0
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            n = 1
            for d in shape:
                n *= d
            total += n * dtype.itemsize
        return total

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.state_content_size_bytes


@dataclass
class KVCacheTensor:
    size: int
    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int = 0


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: Any
    enable_kv_transfer: bool = True


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]
    kv_cache_layout: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _layer_compact(spec: Any, layers: list[str], num_blocks: int) -> tuple[int, KVCacheTensor]:
    page = spec.page_size_bytes
    size = page * num_blocks * len(layers)
    return size, KVCacheTensor(size, layers, page * num_blocks, page)


def dense(num_blocks: int = 256, layout: str = "LBHNC", heads: int = 2) -> KVCacheConfig:
    """The demo's tiny Llama as vLLM's CPU backend lays it out: 2 layers, 2 KV heads x 32,
    bf16, 32-token blocks, layer-outermost."""
    spec = FullAttentionSpec(32, heads, 32, torch.bfloat16)
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    _, t = _layer_compact(spec, layers, num_blocks)
    return KVCacheConfig(num_blocks, [t], [KVCacheGroupSpec(layers, spec)], layout)


# ---- dense --------------------------------------------------------------------------------


def test_dense_tiny_llama_matches_what_the_demo_attaches() -> None:
    t = translate(dense(), model="tiny", backend="CPU_ATTN")
    s = t.spec
    assert [(g.kind, g.logical_block_size, g.kernel_block_size) for g in s.groups] == [
        (GroupKind.FULL_ATTENTION, 32, 32)
    ]
    assert [r.shape for r in s.regions] == [(256, 2, 32, 2, 32)] * 2
    assert {r.layout for r in s.regions} == {Layout.HND}  # LBHNC: heads outside tokens
    assert s.regions[0].block_len == 8192 and s.nbytes == 4_194_304  # the daemon's log line
    assert [p.offset for p in t.placements] == [0, 2_097_152]
    assert s.model == "tiny [vllm-kv layout=LBHNC backend=CPU_ATTN tp=1]"
    assert spec_from_proto(spec_to_proto(s)) == s  # it crosses the wire as it is


def test_token_major_layout_is_nhd_and_one_head_is_nhd_too() -> None:
    assert {r.layout for r in translate(dense(layout="LBNHC"), model="m").spec.regions} == {
        Layout.NHD
    }
    one = translate(dense(heads=1), model="m").spec
    assert {r.layout for r in one.regions} == {Layout.NHD}


def test_fingerprint_separates_page_formats_and_tp() -> None:
    a = translate(dense(), model="m", backend="CPU_ATTN").spec.model
    assert a != translate(dense(layout="LBNHC"), model="m", backend="CPU_ATTN").spec.model
    assert a != translate(dense(), model="m", backend="FLASH_ATTN").spec.model
    assert a != translate(dense(), model="m", backend="CPU_ATTN", tp_size=2).spec.model


def test_block_outermost_layout_gives_strided_regions() -> None:
    spec = FullAttentionSpec(16, 2, 32, torch.float16)
    page, nb = spec.page_size_bytes, 8
    layers = ["a", "b", "c"]
    t = KVCacheTensor(page * nb * 3, layers, layer_stride=page, block_stride=3 * page)
    cfg = KVCacheConfig(nb, [t], [KVCacheGroupSpec(layers, spec)], "BLHNC")
    out = translate(cfg, model="m")
    assert [r.stride for r in out.spec.regions] == [3 * page] * 3
    assert [p.offset for p in out.placements] == [0, page, 2 * page]


# ---- kernel block splitting, sliding window, MLA, Mamba hybrid -----------------------------


def test_kernel_block_smaller_than_the_logical_block() -> None:
    spec = FullAttentionSpec(64, 2, 32, torch.bfloat16)
    layers = ["l0", "l1"]
    _, t = _layer_compact(spec, layers, 16)
    cfg = KVCacheConfig(16, [t], [KVCacheGroupSpec(layers, spec)], "LBHNC")
    s = translate(cfg, model="m", kernel_block_sizes=[32]).spec
    g = s.groups[0]
    assert (g.logical_block_size, g.kernel_block_size, g.ppl) == (64, 32, 2)
    assert s.regions[0].shape == (32, 2, 32, 2, 32)  # 16 logical = 32 kernel blocks
    assert s.num_logical_blocks(0) == 16


def test_sliding_window_and_full_attention_groups() -> None:
    full = FullAttentionSpec(32, 2, 32, torch.bfloat16)
    swa = SlidingWindowSpec(32, 2, 32, torch.bfloat16, sliding_window=256)
    page, nb = full.page_size_bytes, 32
    size = page * nb * 2
    t0 = KVCacheTensor(size, ["full.0"], page * nb, page)
    t1 = KVCacheTensor(size, ["swa.0"], page * nb, page, offset=page * nb)
    cfg = KVCacheConfig(
        nb, [t0, t1], [KVCacheGroupSpec(["full.0"], full), KVCacheGroupSpec(["swa.0"], swa)]
    )
    s = translate(cfg, model="m", layout="LBNHC").spec
    assert [g.kind for g in s.groups] == [GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW]
    assert [(r.name, r.group) for r in s.regions] == [("full.0", 0), ("swa.0", 1)]
    kinds = [(g.vllm_group, g.kind, g.block_size) for g in transfer_groups(cfg)]
    assert kinds == [(0, GroupKind.FULL_ATTENTION, 32), (1, GroupKind.SLIDING_WINDOW, 32)]


def test_mla_latent_is_an_mla_region() -> None:
    spec = MLAAttentionSpec(64, 1, 576, torch.bfloat16, head_size_v=0)
    layers = [f"mla.{i}" for i in range(3)]
    _, t = _layer_compact(spec, layers, 8)
    cfg = KVCacheConfig(8, [t], [KVCacheGroupSpec(layers, spec)], "LBHNC")
    s = translate(cfg, model="deepseek").spec
    assert s.groups[0].kind is GroupKind.MLA
    assert {(r.layout, r.shape) for r in s.regions} == {(Layout.MLA, (8, 64, 576))}


def test_mamba_hybrid_with_kernel_block_smaller_than_logical() -> None:
    """Attention pages of 64 tokens split into 16-token kernel blocks (ppl 4); Mamba states
    padded to the attention page; the two groups overlay the same bytes, as vLLM's hybrid
    allocator does."""
    attn = FullAttentionSpec(64, 2, 32, torch.bfloat16)
    page, nb = attn.page_size_bytes, 10  # 16 KiB pages
    mamba = MambaSpec(64, ((4, 128), (2, 16, 16)), (torch.bfloat16, torch.bfloat16), page)
    size = page * nb * 2
    tensors = [
        KVCacheTensor(size, ["attn.0"], page * nb, page),
        KVCacheTensor(size, ["attn.1"], page * nb, page, offset=page * nb),
        KVCacheTensor(size, ["mamba.0"], page * nb, page),  # overlays attn.0's bytes
        KVCacheTensor(size, ["mamba.1"], page * nb, page, offset=page * nb),
    ]
    groups = [
        KVCacheGroupSpec(["attn.0", "attn.1"], attn),
        KVCacheGroupSpec(["mamba.0", "mamba.1"], mamba),
    ]
    cfg = KVCacheConfig(nb, tensors, groups, "LBHNC")
    out = translate(cfg, model="hybrid", kernel_block_sizes=[16, 64])
    s = out.spec
    fa, mb = s.groups
    assert (fa.kind, fa.logical_block_size, fa.kernel_block_size, fa.ppl) == (
        GroupKind.FULL_ATTENTION,
        64,
        16,
        4,
    )
    assert (mb.kind, mb.ppl) == (GroupKind.MAMBA, 1)
    attn0, mamba0 = s.regions[0], s.regions[2]
    assert attn0.shape == (40, 2, 16, 2, 32) and attn0.stride == page // 4
    assert mamba0.layout is Layout.STATE and mamba0.shape == (10, 1024)  # 2048 bytes of bf16
    assert mamba0.block_len == 2048 and mamba0.stride == page  # padded to the attention page
    assert out.placement("mamba.0").offset == out.placement("attn.0").offset == 0
    assert s.num_logical_blocks(0) == s.num_logical_blocks(1) == nb


# ---- refusals ----------------------------------------------------------------------------


def _one(spec: Any, layout: str = "LBHNC") -> KVCacheConfig:
    _, t = _layer_compact(spec, ["x"], 4)
    return KVCacheConfig(4, [t], [KVCacheGroupSpec(["x"], spec)], layout)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (_one(FullAttentionSpec(32, 2, 32, torch.bfloat16), "LHBNC"), "contiguous span"),
        (_one(FullAttentionSpec(32, 2, 32, torch.bfloat16), "XYZ"), "unknown vLLM KV cache"),
        (_one(FullAttentionSpec(32, 2, 64, torch.bfloat16, head_size_v=32)), "V head size"),
        (_one(FullAttentionSpec(32, 2, 32, torch.bfloat16, kv_quant_mode=2)), "quantisation"),
        (_one(CrossAttentionSpec(32, 2, 32, torch.bfloat16)), "cross-attention KV"),
        (_one(FullAttentionSpec(32, 2, 32, torch.int8)), "not a supported KV dtype"),
    ],
)
def test_refusals_say_what_and_point_at_the_docs(cfg: KVCacheConfig, match: str) -> None:
    with pytest.raises(SpecError, match=match) as ei:
        translate(cfg, model="m")
    assert "docs/vllm.md" in str(ei.value)


# ---- fp8: vLLM's spec says torch.uint8, cache_config.cache_dtype says which fp8 ------------


@pytest.mark.parametrize(
    ("cache_dtype", "want"),
    [("fp8", KVDType.FP8_E4M3), ("fp8_e4m3", KVDType.FP8_E4M3), ("fp8_e5m2", KVDType.FP8_E5M2)],
)
def test_an_fp8_cache_held_as_uint8_is_translated_to_its_fp8_dtype(
    cache_dtype: str, want: KVDType
) -> None:
    spec = FullAttentionSpec(32, 2, 32, torch.uint8)
    out = translate(_one(spec), model="m", cache_dtype=cache_dtype)
    r = out.spec.regions[0]
    assert r.dtype is want and r.block_len == spec.page_size_bytes == 4096
    buf = torch.zeros(out.buffer_size, dtype=torch.uint8)  # vLLM's uint8 allocation
    typed = buf.view(getattr(torch, want.torch_name))
    KVPool.from_tensors(out.spec, {r.name: typed.as_strided(r.shape, region_strides(r))})


def test_the_two_fp8_formats_give_specs_peers_cannot_pair() -> None:
    cfg = _one(FullAttentionSpec(32, 2, 32, torch.uint8))
    e4m3 = translate(cfg, model="m", cache_dtype="fp8_e4m3").spec
    assert e4m3 == translate(cfg, model="m", cache_dtype="fp8").spec
    assert e4m3 != translate(cfg, model="m", cache_dtype="fp8_e5m2").spec


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_ds_mla", "int8"])
def test_uint8_without_an_fp8_cache_dtype_is_refused(cache_dtype: str) -> None:
    with pytest.raises(SpecError, match=rf"torch\.uint8 with cache_dtype '{cache_dtype}'") as ei:
        translate(
            _one(FullAttentionSpec(32, 2, 32, torch.uint8)), model="m", cache_dtype=cache_dtype
        )
    assert "fp8_e5m2" in str(ei.value) and str(ei.value).count("docs/vllm.md") == 1


def test_kernel_block_size_must_divide() -> None:
    with pytest.raises(SpecError, match="does not divide"):
        translate(dense(), model="m", kernel_block_sizes=[24])


# ---- the bytes: daemon check and vLLM-style views -----------------------------------------


def _vllm_views(cfg: KVCacheConfig, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """[B, H, N, C] byte views as vLLM 0.32 builds them for a layer-compact LBHNC cache."""
    out = {}
    for t in cfg.kv_cache_tensors:
        spec = next(g.kv_cache_spec for g in cfg.kv_cache_groups if t.layers[0] in g.layer_names)
        c = (spec.head_size + spec.head_size_v) * spec.dtype.itemsize
        shape = (cfg.num_blocks, spec.num_kv_heads, spec.block_size, c)
        strides = (t.block_stride, spec.block_size * c, c, 1)
        for i, layer in enumerate(t.layers):
            off = t.offset + i * t.layer_stride
            out[layer] = torch.as_strided(buf, shape, strides, off)
    return out


def test_regions_cover_exactly_vllms_blocks_and_pass_the_daemons_check() -> None:
    cfg = dense(num_blocks=8)
    out = translate(cfg, model="m")
    buf = torch.randint(-128, 127, (out.buffer_size,), dtype=torch.int8)
    views = _vllm_views(cfg, buf)
    check_views(out, int(buf.data_ptr()), {k: int(v.data_ptr()) for k, v in views.items()})
    raw = buf.view(torch.uint8)
    tensors = {}
    for r in out.spec.regions:
        p = out.placement(r.name)
        typed = raw[p.offset :].view(torch.bfloat16)
        tensors[r.name] = typed.as_strided(r.shape, region_strides(r))
        for b in range(r.num_blocks):  # block b: the same bytes in both views
            ours = tensors[r.name][b].contiguous().view(torch.uint8).reshape(-1)
            theirs = views[r.name][b].contiguous().view(torch.uint8).reshape(-1)
            assert torch.equal(ours.sort().values, theirs.sort().values)
            start = p.offset + b * r.stride
            assert torch.equal(ours.sort().values, raw[start : start + r.block_len].sort().values)
    KVPool.from_tensors(out.spec, tensors)  # what the daemon runs on an IMPORTED attach


def test_check_views_names_a_misplaced_layer() -> None:
    out = translate(dense(num_blocks=4), model="m")
    with pytest.raises(SpecError, match=r"model.layers.1.self_attn.attn.*expected 32768"):
        check_views(
            out,
            1000,
            {"model.layers.0.self_attn.attn": 1000, "model.layers.1.self_attn.attn": 1000 + 64},
        )
