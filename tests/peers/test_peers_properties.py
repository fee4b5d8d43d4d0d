"""Properties of the check: refusal is symmetric, and compatible peers share a digest."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hypothesis import given, reject, settings
from hypothesis import strategies as st
from peers_specs import attn, peer

from kvxferd.blocks.tp import infer_num_kv_heads
from kvxferd.errors import InvalidRequest, SpecError
from kvxferd.layout import KVCacheSpec, KVDType, Layout, MemoryType, Region, preset
from kvxferd.peers import PeerInfo, check_compatible
from kvxferd.peers._tp import heads_per_rank, total_heads_candidates, tp_ratio

Pair = tuple[PeerInfo, PeerInfo]
TPS = [1, 2, 4, 8, 16]


def _per_rank(total: int, tp: int) -> int:
    return total // tp if total >= tp else 1


@st.composite
def compatible_pairs(draw: st.DrawFn) -> Pair:
    kind = draw(st.sampled_from(["equal_tp", "hetero_tp", "hybrid", "mla", "fp8"]))
    prefix = draw(st.booleans())
    tl, tr = draw(st.sampled_from(TPS)), draw(st.sampled_from(TPS))
    if kind == "equal_tp":
        heads = draw(st.sampled_from([1, 2, 4, 8]))
        layout = draw(st.sampled_from([Layout.NHD, Layout.HND]))
        dtype = draw(st.sampled_from(list(KVDType)))
        spec = attn(heads=heads, layout=layout, dtype=dtype, layers=draw(st.integers(1, 3)))
        return peer(spec, tp=tl, prefix=prefix), peer(spec, tp=tl, rank=tl - 1, prefix=prefix)
    if kind == "hetero_tp":
        total = draw(st.sampled_from([1, 2, 4, 8]))
        layers = draw(st.integers(1, 3))
        return (
            peer(attn(heads=_per_rank(total, tl), layers=layers), tp=tl, prefix=prefix),
            peer(attn(heads=_per_rank(total, tr), layers=layers), tp=tr, prefix=prefix),
        )
    if kind == "hybrid":
        ppl_l = draw(st.sampled_from([2, 34, 66]))
        ppl_r = ppl_l if prefix else draw(st.sampled_from([2, 34, 66]))
        tl, tr = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
        opts = "hybrid:num_blocks=1,attention_layers=1,mamba_layers=1"
        return (
            peer(preset(opts, ppl=ppl_l, num_kv_heads=_per_rank(2, tl)), tp=tl, prefix=prefix),
            peer(preset(opts, ppl=ppl_r, num_kv_heads=_per_rank(2, tr)), tp=tr, prefix=prefix),
        )
    if kind == "mla":
        spec = preset("mla:num_blocks=2,num_layers=2")
        return peer(spec, tp=tl, prefix=prefix), peer(spec, tp=tr, prefix=prefix)
    spec = preset("fp8:num_blocks=2,full_layers=3,sliding_layers=1")
    return peer(spec, prefix=prefix), peer(spec, prefix=prefix)


def _with_regions(spec: KVCacheSpec, regions: list[Region]) -> KVCacheSpec:
    return dataclasses.replace(spec, regions=tuple(regions))


def _token_dim(r: Region) -> int | None:
    if r.layout.has_kv_halves:
        return r.layout.block_dim + 2
    return 1 if r.layout is Layout.MLA else None


def _set_kernel(spec: KVCacheSpec, kernel: int, ppl: int) -> KVCacheSpec:
    g = spec.groups[0]
    if g.kind.is_state:
        reject()
    groups = (
        dataclasses.replace(g, logical_block_size=kernel * ppl, kernel_block_size=kernel),
        *spec.groups[1:],
    )
    regions = []
    for r in spec.regions:
        dim = _token_dim(r)
        if r.group == 0 and dim is not None:
            shape = list(r.shape)
            shape[dim] = kernel
            regions.append(dataclasses.replace(r, shape=tuple(shape)))
        else:
            regions.append(r)
    return KVCacheSpec(spec.model, groups, tuple(regions))


@st.composite
def perturbations(draw: st.DrawFn) -> Callable[[PeerInfo], PeerInfo]:
    """One single-field change to one side's handshake info."""
    what = draw(
        st.sampled_from(
            [
                "version",
                "model",
                "tp",
                "prefix",
                "num_kv_heads",
                "dtype",
                "layout",
                "heads",
                "rename",
                "drop",
                "swap",
                "kernel",
                "ppl",
                "memory",
            ]
        )
    )
    i = draw(st.integers(0, 7))
    value = draw(st.integers(1, 16))
    dtype = draw(st.sampled_from(list(KVDType)))

    def apply(p: PeerInfo) -> PeerInfo:
        spec, regions = p.spec, list(p.spec.regions)
        r = regions[i % len(regions)]
        k = i % len(regions)
        if what == "version":
            return dataclasses.replace(p, protocol_version=p.protocol_version + 1)
        if what == "model":
            return dataclasses.replace(p, spec=dataclasses.replace(spec, model=spec.model + "x"))
        if what == "tp":
            return dataclasses.replace(p, tp_size=value, tp_rank=0)
        if what == "prefix":
            return dataclasses.replace(p, prefix_caching=not p.prefix_caching)
        if what == "num_kv_heads":
            return dataclasses.replace(p, num_kv_heads=value)
        if what == "dtype":
            regions[k] = dataclasses.replace(r, dtype=dtype)
        elif what == "layout":
            swap = {Layout.NHD: Layout.HND, Layout.HND: Layout.NHD}
            if r.layout not in swap:
                reject()
            regions[k] = dataclasses.replace(r, layout=swap[r.layout])
        elif what == "heads":
            if not r.layout.has_kv_halves:
                reject()
            regions[k] = dataclasses.replace(r, shape=(*r.shape[:-2], value, r.shape[-1]))
        elif what == "rename":
            regions[k] = dataclasses.replace(r, name=r.name + "x")
        elif what == "drop":
            regions.pop(k)
        elif what == "swap":
            regions[0], regions[k] = regions[k], regions[0]
        elif what == "kernel":
            g = spec.groups[0]
            return dataclasses.replace(p, spec=_set_kernel(spec, 8 * (1 + i % 3), g.ppl))
        elif what == "ppl":
            g = spec.groups[0]
            return dataclasses.replace(p, spec=_set_kernel(spec, g.kernel_block_size, value))
        else:
            return dataclasses.replace(p, spec=spec.with_memory(MemoryType.VRAM))
        return dataclasses.replace(p, spec=_with_regions(spec, regions))

    return apply


@settings(max_examples=150, deadline=None)
@given(compatible_pairs())
def test_generated_pairs_are_compatible(pair: Pair) -> None:
    a, b = pair
    assert check_compatible(a, b).compatible, [str(m) for m in check_compatible(a, b)]
    assert a.compat_digest() == b.compat_digest()


@settings(max_examples=400, deadline=None)
@given(compatible_pairs(), perturbations(), st.booleans(), st.booleans())
def test_refusal_is_symmetric(
    pair: Pair, change: Callable[[PeerInfo], PeerInfo], on_remote: bool, convert: bool
) -> None:
    a, b = pair
    try:
        if on_remote:
            b = change(b)
        else:
            a = change(a)
    except (SpecError, InvalidRequest):
        reject()
    ab = check_compatible(a, b, allow_layout_conversion=convert)
    ba = check_compatible(b, a, allow_layout_conversion=convert)
    assert ab.compatible == ba.compatible
    assert len(ab) == len(ba)
    assert all(m.fix for m in (*ab, *ba))
    if ab.compatible:
        # Compatible peers always share a digest, so a differing digest is a safe early refusal.
        assert a.compat_digest(allow_layout_conversion=convert) == b.compat_digest(
            allow_layout_conversion=convert
        )


@given(st.sampled_from([1, 2, 3, 4, 6, 8, 16]), st.sampled_from([1, 2, 3, 4, 6, 8, 16]))
def test_tp_ratio(local_tp: int, remote_tp: int) -> None:
    ratio = tp_ratio(local_tp, remote_tp)
    if ratio is None:
        assert local_tp % remote_tp and remote_tp % local_tp
    elif ratio > 0:
        assert local_tp == remote_tp * ratio
    else:
        assert remote_tp == local_tp * -ratio
        assert tp_ratio(remote_tp, local_tp) == -ratio


@given(
    st.integers(1, 16),
    st.sampled_from([1, 2, 3, 4, 6, 8, 16]),
    st.sampled_from([1, 2, 3, 4, 6, 8, 16]),
    st.integers(1, 16),
    st.integers(1, 16),
)
def test_heads_agreement_matches_the_planners_inference(
    total: int, tl: int, tr: int, hl: int, hr: int
) -> None:
    """Per-rank head counts the handshake accepts are exactly those the planner can read."""
    if tp_ratio(tl, tr) is None:
        return
    try:
        infer_num_kv_heads(hl, tl, hr, tr)
        planner_ok = True
    except InvalidRequest:
        planner_ok = False
    both = total_heads_candidates(hl, tl, None) & total_heads_candidates(hr, tr, None)
    assert bool(both) == planner_ok
    # Heads split from one real model always agree.
    el, er = heads_per_rank(total, tl), heads_per_rank(total, tr)
    if el is not None and er is not None:
        assert total_heads_candidates(el, tl, total) & total_heads_candidates(er, tr, None)
