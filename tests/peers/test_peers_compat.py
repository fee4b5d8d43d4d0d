"""The handshake compatibility check: every mismatch kind, each with a fix, all at once."""

from __future__ import annotations

import dataclasses

import pytest
from peers_specs import attn, peer

from kvxferd.errors import IncompatiblePeer, InvalidRequest, Mismatch
from kvxferd.layout import (
    GroupKind,
    KVCacheSpec,
    KVDType,
    KVGroup,
    Layout,
    MemoryType,
    preset,
)
from kvxferd.peers import (
    PROTOCOL_VERSION,
    CompatReport,
    PeerInfo,
    check_compatible,
    require_compatible,
)


def only(report: CompatReport) -> Mismatch:
    assert len(report) == 1, [str(m) for m in report]
    return report.mismatches[0]


def both_ways(a: PeerInfo, b: PeerInfo, **kw: bool) -> tuple[CompatReport, CompatReport]:
    return check_compatible(a, b, **kw), check_compatible(b, a, **kw)


# --- compatible pairs ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "dense:num_blocks=4",
        "dense:num_blocks=4,layout=HND",
        "dense:num_blocks=4,cross_layer=1",
        "hybrid:num_blocks=2",
        "mla:num_blocks=4",
        "fp8:num_blocks=4",
    ],
)
def test_identical_specs_are_compatible(name: str) -> None:
    spec = preset(name)
    report = require_compatible(peer(spec, prefix=True), peer(spec, prefix=True))
    assert report.compatible and len(report) == 0 and list(report) == []
    assert report.tp_ratio == 1


def test_memory_type_block_count_and_stride_may_differ() -> None:
    local = attn(num_blocks=32).with_memory(MemoryType.VRAM)
    base = attn(num_blocks=100)
    padded = tuple(dataclasses.replace(r, block_stride=r.block_len + 512) for r in base.regions)
    remote = dataclasses.replace(base, regions=padded)
    assert check_compatible(peer(local), peer(remote)).compatible


# --- one mismatch kind at a time ------------------------------------------------------------


def test_protocol_version() -> None:
    m = only(check_compatible(peer(attn()), peer(attn(), version=PROTOCOL_VERSION + 1)))
    assert m.what == "protocol version"
    assert (m.local, m.remote) == (str(PROTOCOL_VERSION), str(PROTOCOL_VERSION + 1))
    assert "upgrade" in m.fix


def test_model_fingerprint() -> None:
    m = only(check_compatible(peer(attn(model="a")), peer(attn(model="b"))))
    assert m.what == "model fingerprint" and (m.local, m.remote) == ("'a'", "'b'")
    assert "same model" in m.fix


def test_region_count_names_the_missing_regions() -> None:
    m = only(check_compatible(peer(attn(layers=4)), peer(attn(layers=3))))
    assert m.what == "region count"
    assert m.local == "4 regions (1 not on the remote side: 'layer.3')"
    assert m.remote == "3 regions"
    assert "same order" in m.fix


def test_region_order_reports_each_position() -> None:
    spec = attn(layers=3)
    swapped = dataclasses.replace(spec, regions=(spec.regions[1], spec.regions[0], spec.regions[2]))
    report = check_compatible(peer(spec), peer(swapped))
    assert [m.what for m in report] == ["region #0: name", "region #1: name"]
    first = report.mismatches[0]
    assert (first.local, first.remote) == ("'layer.0'", "'layer.1'")
    assert "the remote has 'layer.0' at #1" in first.fix


def test_renamed_region_says_it_is_missing() -> None:
    spec = attn(layers=2)
    renamed = dataclasses.replace(
        spec, regions=(spec.regions[0], dataclasses.replace(spec.regions[1], name="attn.1"))
    )
    m = only(check_compatible(peer(spec), peer(renamed)))
    assert m.what == "region #1: name"
    assert "the remote has no region 'layer.1'" in m.fix
    assert "the local side has no region 'attn.1'" in m.fix


def test_per_layer_dtype() -> None:
    local = preset("fp8:num_blocks=4")
    regions = list(local.regions)
    assert regions[0].dtype is KVDType.FP8_E4M3
    regions[0] = dataclasses.replace(regions[0], dtype=KVDType.BF16)
    remote = dataclasses.replace(local, regions=tuple(regions))
    m = only(check_compatible(peer(local), peer(remote)))
    assert str(m).startswith("region 'layer.0': dtype is local fp8_e4m3, remote bf16 (fix: ")
    assert "per layer" in m.fix


def test_identical_mismatches_over_many_regions_merge_into_one() -> None:
    local = attn(layers=3, dtype=KVDType.FP8_E4M3)
    m = only(check_compatible(peer(local), peer(attn(layers=3))))
    assert m.what == "regions 'layer.0', 'layer.1', 'layer.2': dtype"


def test_layout_differs_unless_conversion_is_configured() -> None:
    nhd, hnd = peer(attn(layout=Layout.NHD)), peer(attn(layout=Layout.HND))
    m = only(check_compatible(nhd, hnd))
    assert m.what == "regions 'layer.0', 'layer.1', 'layer.2', 'layer.3': layout"
    assert (m.local, m.remote) == ("NHD", "HND")
    assert "conversion" in m.fix
    assert check_compatible(nhd, hnd, allow_layout_conversion=True).compatible


def test_conversion_never_crosses_layout_families() -> None:
    per_layer = preset("dense:num_blocks=4,num_layers=1")
    per_layer = dataclasses.replace(
        per_layer, regions=(dataclasses.replace(per_layer.regions[0], name="layers"),)
    )
    cross = preset("dense:num_blocks=4,num_layers=1,cross_layer=1")
    m = only(check_compatible(peer(per_layer), peer(cross), allow_layout_conversion=True))
    assert m.what == "region 'layers': layout"
    assert m.local == "NHD (attention)" and m.remote == "CROSS_LAYER_NHD (cross-layer attention)"


def test_head_size_differs() -> None:
    m = only(check_compatible(peer(attn(head_size=64)), peer(attn(head_size=128))))
    assert m.what.endswith(": shape per KV head (without block and heads dims)")
    assert (m.local, m.remote) == ("[2, 16, 64]", "[2, 16, 128]")


def test_kernel_block_sizes_that_tile_are_compatible_and_others_name_sizes_that_would() -> None:
    """docs/domain.md §5 rule 3: pulls re-block at the smaller kernel block."""
    assert check_compatible(peer(attn(block=16)), peer(attn(block=32))).mismatches == ()
    report = check_compatible(peer(attn(block=16)), peer(attn(block=24)))
    (m,) = report.mismatches
    assert m.what == "group #0 'full': kernel block size (tokens)"
    assert (m.local, m.remote) == ("16", "24")
    # the remote's logical block is 24 tokens: 1, 2, 4, 8 divide 16 and 24; 24 is not a
    # multiple of 16; this side (logical 16) could run 1, 2, 4, 8 or 16... against 24: 1, 2, 4, 8
    assert "run the remote with one of [1, 2, 4, 8]" in m.fix
    assert "this side with one of [1, 2, 4, 8]" in m.fix
    prefix = check_compatible(peer(attn(block=16), prefix=True), peer(attn(block=32), prefix=True))
    (p,) = prefix.mismatches
    assert p.what == "group #0 'full': logical block size (tokens) with prefix caching on"
    assert (p.local, p.remote) == ("16", "32")


def test_group_count_and_kind() -> None:
    fa = attn(layers=2)
    two = KVCacheSpec(
        "llama",
        (fa.groups[0], KVGroup("swa", GroupKind.SLIDING_WINDOW, 16, 16)),
        (fa.regions[0], dataclasses.replace(fa.regions[1], group=1)),
    )
    report = check_compatible(peer(fa), peer(two))
    assert [m.what for m in report] == ["KV cache groups", "region 'layer.1': KV cache group"]
    assert report.mismatches[0].local == "1 (full:full_attention)"
    assert report.mismatches[0].remote == "2 (full:full_attention, swa:sliding_window)"
    assert report.mismatches[1].remote == "#1 'swa' (sliding_window)"

    swa = dataclasses.replace(fa, groups=(KVGroup("full", GroupKind.SLIDING_WINDOW, 16, 16),))
    m = only(check_compatible(peer(fa), peer(swa)))
    assert m.what == "group #0 'full': kind"
    assert (m.local, m.remote) == ("full_attention", "sliding_window")


def test_region_kind_differs_is_refused_even_with_conversion() -> None:
    mla = preset("mla:num_blocks=4,num_layers=1")
    dense = preset("dense:num_blocks=4,num_layers=1,block_size=64")
    dense = dataclasses.replace(dense, model=mla.model)
    report = check_compatible(peer(mla), peer(dense), allow_layout_conversion=True)
    assert [m.what for m in report] == [
        "group #0 (local 'mla', remote 'full'): kind",
        "region 'layer.0': layout",
    ]
    assert report.mismatches[1].local == "MLA (MLA)"


def test_prefix_caching_flag_differs() -> None:
    m = only(check_compatible(peer(attn(), prefix=True), peer(attn(), prefix=False)))
    assert (m.what, m.local, m.remote) == ("prefix caching", "on", "off")


def test_peer_info_validates_its_numbers() -> None:
    with pytest.raises(InvalidRequest, match=r"TP rank 2 is outside 0\.\.1"):
        peer(attn(), tp=2, rank=2)
    with pytest.raises(InvalidRequest, match="TP size"):
        peer(attn(), tp=0)
    with pytest.raises(InvalidRequest, match="protocol version"):
        peer(attn(), version=0)
    with pytest.raises(InvalidRequest, match="num_kv_heads"):
        peer(attn(), num_kv_heads=0)


# --- ppl and prefix caching (docs/domain.md §5) --------------------------------------------


def hybrid_pair(*, local_prefix: bool, remote_prefix: bool) -> tuple[PeerInfo, PeerInfo]:
    """Decode TP 2 with ppl 66 (1 KV head/rank) against prefill TP 1 with ppl 34 (2 heads)."""
    local = preset("hybrid:num_blocks=2,ppl=66,num_kv_heads=1")
    remote = preset("hybrid:num_blocks=2,ppl=34,num_kv_heads=2")
    return (
        peer(local, tp=2, rank=1, prefix=local_prefix),
        peer(remote, tp=1, prefix=remote_prefix),
    )


def test_hybrid_ppl_34_vs_66_without_prefix_caching_is_compatible() -> None:
    local, remote = hybrid_pair(local_prefix=False, remote_prefix=False)
    report = require_compatible(local, remote)
    assert report.tp_ratio == 2
    assert local.compat_digest() == remote.compat_digest()


def test_hybrid_ppl_34_vs_66_with_prefix_caching_is_refused() -> None:
    local, remote = hybrid_pair(local_prefix=True, remote_prefix=True)
    with pytest.raises(IncompatiblePeer) as info:
        require_compatible(local, remote)
    (m,) = info.value.mismatches
    assert (
        m.what
        == "group #0 'attention': kernel blocks per logical block (ppl) with prefix caching on"
    )
    assert m.local.startswith("66 ") and m.remote.startswith("34 ")
    assert "disable prefix caching" in m.fix and "66" in m.fix and "34" in m.fix


def test_hybrid_ppl_differs_with_prefix_caching_on_one_side() -> None:
    local, remote = hybrid_pair(local_prefix=False, remote_prefix=True)
    whats = [m.what for m in check_compatible(local, remote)]
    assert whats == [
        "prefix caching",
        "group #0 'attention': kernel blocks per logical block (ppl) with prefix caching on",
    ]


def test_equal_ppl_with_prefix_caching_is_compatible() -> None:
    spec = preset("hybrid:num_blocks=2,ppl=34")
    assert check_compatible(peer(spec, prefix=True), peer(spec, prefix=True)).compatible


# --- heterogeneous TP (docs/domain.md §6) --------------------------------------------------


def test_decode_tp2_reads_hnd_halves_of_prefill_tp1() -> None:
    decode = peer(attn(heads=4), tp=2, rank=1)
    prefill = peer(attn(heads=8), tp=1)
    assert decode.spec.regions[0].block_len * 2 == prefill.spec.regions[0].block_len
    a, b = both_ways(decode, prefill)
    assert a.compatible and b.compatible
    assert (a.tp_ratio, b.tp_ratio) == (2, -2)
    assert decode.compat_digest() == prefill.compat_digest()


def test_prefill_tp4_decode_tp2() -> None:
    decode = peer(attn(heads=4), tp=2)
    prefill = peer(attn(heads=2), tp=4, rank=3)
    report = require_compatible(decode, prefill)
    assert report.tp_ratio == -2


def test_mla_is_replicated_across_tp() -> None:
    spec = preset("mla:num_blocks=4,num_layers=2")
    assert require_compatible(peer(spec, tp=4, rank=2), peer(spec, tp=1)).tp_ratio == 4
    assert require_compatible(peer(spec, tp=2), peer(spec, tp=8)).tp_ratio == -4


def test_mla_block_shape_must_be_equal() -> None:
    small = preset("mla:num_blocks=4,num_layers=1,latent_dim=512")
    m = only(check_compatible(peer(preset("mla:num_blocks=4,num_layers=1"), tp=2), peer(small)))
    assert m.what == "region 'layer.0': block shape (replicated across TP, without the block dim)"
    assert m.local == "[64, 576] (73728 B/block)" and m.remote == "[64, 512] (65536 B/block)"
    assert "replicated" in m.fix


def test_sharded_mamba_state_under_heterogeneous_tp_is_refused() -> None:
    local = preset("hybrid:num_blocks=2,num_kv_heads=1,mamba_layers=1")
    remote = preset("hybrid:num_blocks=2,num_kv_heads=2,mamba_layers=1")
    regions = list(remote.regions)
    conv = regions.index(next(r for r in regions if r.name == "mamba.0.conv"))
    regions[conv] = dataclasses.replace(regions[conv], shape=(2, 3, 2048))
    remote = dataclasses.replace(remote, regions=tuple(regions))
    m = only(check_compatible(peer(local, tp=2), peer(remote, tp=1)))
    assert m.what.startswith("region 'mamba.0.conv': block shape")


def test_kv_heads_replicated_when_tp_exceeds_them() -> None:
    # 8 KV heads: TP 8 and TP 16 both hold one head per rank (TP 16 has two copies of each),
    # so blocks are equal-sized copies and even NHD needs no slicing.
    one_head = attn(heads=1, layout=Layout.NHD)
    report = require_compatible(peer(one_head, tp=16, num_kv_heads=8), peer(one_head, tp=8))
    assert report.tp_ratio == 2
    # 2 KV heads: prefill TP 1 holds both, decode TP 4 holds one (replicated): sliced, HND.
    assert require_compatible(peer(attn(heads=1), tp=4), peer(attn(heads=2), tp=1)).compatible


def test_unsharded_decode_blocks_are_refused_with_expected_block_len() -> None:
    decode = peer(attn(heads=8), tp=2)  # forgot to shard: should hold 4 heads
    prefill = peer(attn(heads=8), tp=1)
    m = only(check_compatible(decode, prefill))
    assert m.what == "regions 'layer.0', 'layer.1', 'layer.2', 'layer.3': KV heads per rank vs TP"
    assert m.local == "8 KV heads/rank at TP 2 (block_len 32768 B)"
    assert m.remote == "8 KV heads/rank at TP 1 (block_len 32768 B)"
    assert "the local side at TP 2 should hold 4 per rank (block_len 16384 B)" in m.fix
    assert "the remote side at TP 1 should hold 16 per rank (block_len 65536 B)" in m.fix
    assert "local block_len x 2 == remote block_len" in m.fix


def test_declared_kv_heads_must_fit_the_heads_per_rank() -> None:
    m = only(check_compatible(peer(attn(heads=2), tp=2, num_kv_heads=8), peer(attn(heads=4), tp=1)))
    assert m.what.endswith("KV heads per rank vs TP")
    assert "the local side declares 8 KV heads but holds 2 per rank at TP 2" in m.fix

    report = check_compatible(
        peer(attn(heads=4), tp=2, num_kv_heads=8), peer(attn(heads=4), tp=2, num_kv_heads=4)
    )
    assert [m.what for m in report] == ["model KV heads (before TP)"]


def test_tp_sizes_that_do_not_divide() -> None:
    m = only(check_compatible(peer(attn(heads=4), tp=2), peer(attn(heads=8), tp=3)))
    assert (m.what, m.local, m.remote) == ("tensor-parallel size", "TP 2", "TP 3")
    assert "divides" in m.fix
    assert check_compatible(peer(attn(), tp=2), peer(attn(), tp=3)).tp_ratio is None


def test_nhd_with_heterogeneous_tp_says_set_hnd() -> None:
    decode = peer(attn(heads=4, layout=Layout.NHD), tp=2)
    prefill = peer(attn(heads=8, layout=Layout.NHD), tp=1)
    m = only(check_compatible(decode, prefill))
    assert (
        m.what == "regions 'layer.0', 'layer.1', 'layer.2', 'layer.3': layout for KV-head slicing"
    )
    assert (m.local, m.remote) == ("NHD", "NHD")
    assert "set the HND layout" in m.fix and "on the local and remote sides:" in m.fix
    # One side already HND: the fix names only the other side, and conversion does not help.
    prefill_hnd = peer(attn(heads=8, layout=Layout.HND), tp=1)
    m = only(check_compatible(decode, prefill_hnd, allow_layout_conversion=True))
    assert "on the local side:" in m.fix


# --- everything at once ----------------------------------------------------------------------


def test_every_mismatch_is_reported_in_one_refusal() -> None:
    local = peer(attn(model="a", heads=4, layout=Layout.NHD), tp=2, name="decode-0")
    remote_spec = attn(
        model="b", heads=8, layout=Layout.NHD, layers=3, dtypes={1: KVDType.FP8_E4M3}
    )
    remote = peer(remote_spec, tp=1, prefix=True, version=PROTOCOL_VERSION + 1, name="prefill-0")
    with pytest.raises(IncompatiblePeer) as info:
        require_compatible(local, remote)
    err = info.value
    whats = [m.what for m in err.mismatches]
    assert whats == [
        "protocol version",
        "model fingerprint",
        "prefix caching",
        "region count",
        "regions 'layer.0', 'layer.1', 'layer.2': layout for KV-head slicing",
        "region 'layer.1': dtype",
    ]
    assert err.peer == "prefill-0"
    text = str(err)
    assert text.startswith(f"handshake with prefill-0 refused, {len(whats)} mismatch(es): ")
    for m in err.mismatches:
        assert str(m) in text and m.fix
