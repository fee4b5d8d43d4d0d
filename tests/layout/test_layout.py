"""The layout model: presets, TOML round-trips, tensor inference and its refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.errors import SpecError
from kvxferd.layout import (
    GroupKind,
    KVCacheSpec,
    KVDType,
    KVGroup,
    Layout,
    MemoryType,
    Region,
    dump_spec,
    load_spec,
    preset,
    spec_from_dict,
)
from kvxferd.layout.alloc import allocate_pool
from kvxferd.layout.tensors import infer_layout, spec_from_tensors
from kvxferd.pool import KVPool

SMALL = [
    "dense:num_blocks=8",
    "dense:num_blocks=8,layout=HND",
    "dense:num_blocks=8,cross_layer=1",
    "dense:num_blocks=8,cross_layer=1,layout=HND",
    "hybrid:num_blocks=2",
    "hybrid:num_blocks=2,ppl=34",
    "mla:num_blocks=4",
    "fp8:num_blocks=4",
]


@pytest.mark.parametrize("name", SMALL)
def test_preset_tensors_round_trip(name: str) -> None:
    spec = preset(name)
    pool = allocate_pool(spec)
    back = spec_from_tensors(
        spec.model, spec.groups, {r.name: (r.group, pool[r.name]) for r in spec.regions}
    )
    assert back == spec


@pytest.mark.parametrize("name", SMALL)
def test_preset_toml_round_trip(name: str, tmp_path: object) -> None:
    spec = preset(name)
    import pathlib

    p = pathlib.Path(str(tmp_path)) / "spec.toml"
    p.write_text(dump_spec(spec))
    assert load_spec(p) == spec
    assert load_spec(p).digest() == spec.digest()


def test_dense_matches_llama_3_8b_numbers() -> None:
    spec = preset("dense")
    assert len(spec.regions) == 32
    r = spec.regions[0]
    assert r.block_len == 2 * 16 * 8 * 128 * 2 == 65536
    assert r.num_blocks == 512
    assert spec.nbytes == 1 << 30


def test_cross_layer_block_holds_every_layer() -> None:
    r = preset("dense:cross_layer=1").regions[0]
    assert r.layout is Layout.CROSS_LAYER_NHD
    assert r.stride_order == (1, 0, 2, 3, 4, 5)
    assert r.block_len == 32 * 65536
    assert r.num_layers == 32


def test_hybrid_groups_and_ppl() -> None:
    spec = preset("hybrid:ppl=34,num_blocks=3")
    attn, mamba = spec.groups
    assert (attn.ppl, mamba.ppl) == (34, 1)
    assert mamba.kind is GroupKind.MAMBA
    assert spec.num_kernel_blocks(0) == 3 * 34
    assert spec.num_logical_blocks(0) == 3
    assert spec.num_kernel_blocks(1) == 3


def test_fp8_has_bf16_skip_layers_per_region() -> None:
    spec = preset("fp8")
    dtypes = {r.dtype for r in spec.regions}
    assert dtypes == {KVDType.FP8_E4M3, KVDType.BF16}
    for r in spec.regions:
        assert (r.dtype is KVDType.BF16) == (spec.groups[r.group].kind is GroupKind.SLIDING_WINDOW)
    assert sum(r.dtype is KVDType.BF16 for r in spec.regions) == 8


def test_toml_repeat_and_block_stride(tmp_path: object) -> None:
    import pathlib

    p = pathlib.Path(str(tmp_path)) / "s.toml"
    p.write_text(
        """
model = "m"
[[groups]]
name = "full"
kind = "full_attention"
logical_block_size = 32
kernel_block_size = 16
[[regions]]
name = "layer.{i}"
repeat = 3
group = "full"
dtype = "fp8"
layout = "hnd"
shape = [64, 2, 16, 4, 64]
block_stride = 16384
"""
    )
    spec = load_spec(p)
    assert [r.name for r in spec.regions] == ["layer.0", "layer.1", "layer.2"]
    r = spec.regions[1]
    assert (r.dtype, r.layout, r.block_len, r.stride) == (KVDType.FP8_E4M3, Layout.HND, 8192, 16384)
    assert spec.groups[0].ppl == 2
    assert spec.num_logical_blocks(0) == 32


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"groups": [{"name": "g", "kind": "banana", "logical_block_size": 16}]}, "kind"),
        ({"model": ""}, "model"),
        ({"regions": [{"name": "r", "group": "nope"}]}, "not declared"),
        ({"extra": 1}, "unknown top-level"),
    ],
)
def test_toml_refusals_name_the_problem(patch: dict[str, object], needle: str) -> None:
    base: dict[str, object] = {
        "model": "m",
        "groups": [{"name": "g", "kind": "full_attention", "logical_block_size": 16}],
        "regions": [
            {"name": "r", "group": "g", "dtype": "bf16", "layout": "NHD", "shape": [4, 2, 16, 1, 8]}
        ],
    }
    base.update(patch)
    with pytest.raises(SpecError, match=needle):
        spec_from_dict(base)


def test_kv_first_tensor_is_refused_with_what_was_found() -> None:
    t = torch.zeros(2, 64, 16, 8, 128, dtype=torch.bfloat16)  # (2, num_blocks, ...)
    with pytest.raises(SpecError, match="K/V-first") as ei:
        infer_layout("layer.0", GroupKind.FULL_ATTENTION, t.shape, t.stride(), 2)
    assert "blocks-first" in ei.value.fix


def test_kv_first_storage_viewed_blocks_first_is_refused() -> None:
    # Logical blocks-first shape, but memory is K/V-first: the block dim is not outermost.
    t = torch.zeros(2, 64, 16, 8, 128).permute(1, 0, 2, 3, 4)
    with pytest.raises(SpecError, match="not outermost"):
        infer_layout("layer.0", GroupKind.FULL_ATTENTION, t.shape, t.stride(), 4)


def test_non_dense_block_is_refused() -> None:
    t = torch.zeros(8, 2, 16, 8, 256)[..., :128]
    with pytest.raises(SpecError, match="dense blocks"):
        infer_layout("x", GroupKind.FULL_ATTENTION, t.shape, t.stride(), 4)


def test_padded_blocks_are_accepted_with_their_stride() -> None:
    big = torch.zeros(8, 2 * 16 * 8 * 128 + 64)
    t = big[:, : 2 * 16 * 8 * 128].view(8, 2, 16, 8, 128)
    tl = infer_layout("x", GroupKind.FULL_ATTENTION, t.shape, t.stride(), 4)
    assert tl.layout is Layout.NHD
    assert tl.block_stride == (2 * 16 * 8 * 128 + 64) * 4
    assert tl.block_len == 2 * 16 * 8 * 128 * 4


def test_hnd_is_read_from_strides_not_a_default() -> None:
    nhd = torch.zeros(4, 2, 16, 8, 64)
    hnd = torch.zeros(4, 2, 8, 16, 64).permute(0, 1, 3, 2, 4)
    assert nhd.shape == hnd.shape
    f = GroupKind.FULL_ATTENTION
    assert infer_layout("a", f, nhd.shape, nhd.stride(), 4).layout is Layout.NHD
    assert infer_layout("b", f, hnd.shape, hnd.stride(), 4).layout is Layout.HND


def test_state_layout_only_for_mamba() -> None:
    t = torch.zeros(4, 3, 1024)
    assert infer_layout("s", GroupKind.MAMBA, t.shape, t.stride(), 4).layout is Layout.STATE
    assert infer_layout("m", GroupKind.MLA, t.shape, t.stride(), 4).layout is Layout.MLA
    with pytest.raises(SpecError):
        infer_layout("a", GroupKind.FULL_ATTENTION, t.shape, t.stride(), 4)


def test_spec_validation_errors() -> None:
    g = KVGroup("full", GroupKind.FULL_ATTENTION, 16, 16)
    with pytest.raises(SpecError, match="multiple"):
        KVGroup("x", GroupKind.FULL_ATTENTION, 24, 16)
    with pytest.raises(SpecError, match="K and V"):
        Region("r", 0, KVDType.BF16, Layout.NHD, (4, 3, 16, 1, 8))
    with pytest.raises(SpecError, match="kernel block size"):
        KVCacheSpec("m", (g,), (Region("r", 0, KVDType.BF16, Layout.NHD, (4, 2, 8, 1, 8)),))
    with pytest.raises(SpecError, match="cannot hold"):
        KVCacheSpec("m", (g,), (Region("r", 0, KVDType.BF16, Layout.MLA, (4, 16, 8)),))
    with pytest.raises(SpecError, match="disagree"):
        KVCacheSpec(
            "m",
            (g,),
            (
                Region("a", 0, KVDType.BF16, Layout.NHD, (4, 2, 16, 1, 8)),
                Region("b", 0, KVDType.BF16, Layout.NHD, (5, 2, 16, 1, 8)),
            ),
        )
    with pytest.raises(SpecError, match="unknown preset"):
        preset("llama-70b")
    with pytest.raises(SpecError, match="does not take"):
        preset("mla:ppl=3")


@settings(max_examples=60, deadline=None)
@given(
    blocks=st.integers(1, 6),
    heads=st.integers(1, 4),
    hs=st.sampled_from([8, 16]),
    bs=st.sampled_from([1, 4, 16]),
    layout=st.sampled_from(list(Layout)),
    dtype=st.sampled_from(list(KVDType)),
)
def test_any_allocated_region_infers_back(  # noqa: PLR0917
    blocks: int, heads: int, hs: int, bs: int, layout: Layout, dtype: KVDType
) -> None:
    if layout is Layout.MLA:
        kind, shape, kbs = GroupKind.MLA, (blocks, bs, hs), bs
    elif layout is Layout.STATE:
        kind, shape, kbs = GroupKind.MAMBA, (blocks, heads, hs), 16
    elif layout.is_cross_layer:
        kind, shape, kbs = GroupKind.FULL_ATTENTION, (3, blocks, 2, bs, heads, hs), bs
    else:
        kind, shape, kbs = GroupKind.FULL_ATTENTION, (blocks, 2, bs, heads, hs), bs
    spec = KVCacheSpec(
        "m",
        (KVGroup("g", kind, kbs, kbs),),
        (Region("r", 0, dtype, layout, shape, MemoryType.DRAM),),
    )
    pool = allocate_pool(spec)
    t = pool["r"]
    tl = infer_layout("r", kind, t.shape, t.stride(), dtype.itemsize)
    # Size-1 dims make some layouts indistinguishable; the bytes per block never are.
    assert tl.block_len == spec.regions[0].block_len
    if min(shape) > 1:
        assert tl.layout is layout


def test_fill_pattern_makes_every_block_distinct() -> None:
    from kvxferd.pool import KVPool

    pool = KVPool.allocate(preset("dense:num_blocks=600,num_layers=2"))
    pool.fill_pattern(0, range(600), seed=3)
    digests = pool.checksums(0, list(range(600)))
    assert len(set(digests)) == 600
    other = KVPool.allocate(preset("dense:num_blocks=600,num_layers=2"))
    other.fill_pattern(0, range(600), seed=4)
    assert set(other.checksums(0, list(range(600)))).isdisjoint(digests)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("repeat", "thirty-two"),
        ("repeat", 2.9),  # was truncated to 2
        ("block_stride", 1024.9),  # was truncated to 1024
        ("block_stride", True),
        ("shape", [4, 2, 16, True, 8]),  # a boolean is not a dimension
    ],
)
def test_toml_numbers_are_whole_numbers_or_refused_naming_the_key(key: str, value: object) -> None:
    region = {"name": "r{i}", "group": "g", "dtype": "bf16", "layout": "NHD"}
    region |= {"shape": [4, 2, 16, 1, 8], key: value}
    data = {
        "model": "m",
        "groups": [{"name": "g", "kind": "full_attention", "logical_block_size": 16}],
        "regions": [region],
    }
    with pytest.raises(SpecError) as err:
        spec_from_dict(data)
    assert err.value.field == f"regions[0].{key}" and err.value.fix


def test_one_head_per_block_reads_as_the_layout_the_spec_declares() -> None:
    """With one KV head per block NHD and HND have the same bytes (docs/domain.md §2: layouts
    are read, never assumed): tensors allocated exactly as an HND spec describes attach as HND
    (they were read as NHD and refused), and with nothing declared NHD, the first, is read."""
    spec = preset("dense:num_blocks=8,num_kv_heads=1,head_size=16,layout=HND")
    assert {r.layout for r in spec.regions} == {Layout.HND}
    pool = KVPool.from_tensors(spec, allocate_pool(spec))
    assert {r.layout for r in pool.spec.regions} == {Layout.HND}
    t = allocate_pool(spec)[spec.regions[0].name]
    kind = spec.groups[0].kind
    assert infer_layout("x", kind, t.shape, t.stride(), 2).layout is Layout.NHD
    assert infer_layout("x", kind, t.shape, t.stride(), 2, prefer=Layout.HND).layout is Layout.HND
    # A preference the strides rule out is not taken: two heads, allocated NHD.
    two = preset("dense:num_blocks=8,num_kv_heads=2,head_size=16")
    t2 = allocate_pool(two)[two.regions[0].name]
    got = infer_layout("x", kind, t2.shape, t2.stride(), 2, prefer=Layout.HND)
    assert got.layout is Layout.NHD


@pytest.mark.parametrize(
    "text",
    ["dense:num_layers=100000000", "hybrid:mamba_layers=5000", "mla:num_layers=4097"],
)
def test_a_preset_with_more_layers_than_any_model_is_refused_before_it_is_built(text: str) -> None:
    # An Attach naming 10^8 layers once held the daemon's loop for minutes, its memory growing
    # by ~0.5 KB a layer (a helper's hostile-input review). Refused at once, naming the key.
    import time

    from kvxferd.layout.presets import MAX_PRESET_LAYERS, preset

    t0 = time.monotonic()
    with pytest.raises(SpecError) as err:
        preset(text)
    assert time.monotonic() - t0 < 1.0
    assert err.value.field.startswith("preset.") and err.value.field.endswith("layers")
    assert str(MAX_PRESET_LAYERS) in err.value.fix
    assert preset(f"dense:num_layers={MAX_PRESET_LAYERS},num_blocks=1").regions  # the cap itself
