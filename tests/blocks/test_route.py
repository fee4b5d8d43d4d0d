"""kvxferd/blocks/route.py: the plain route plans what the general planner plans, field by
field, and refuses what it refuses with the same error; it applies only to plain spec pairs."""

from __future__ import annotations

import numpy as np
import pytest
from blocks_helpers import FA, MAMBA, MLA, PROPS, SWA, attn_region, group, mla_region, spec
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.blocks import plan_pull
from kvxferd.blocks import route as route_mod
from kvxferd.blocks.plan import plan_general
from kvxferd.blocks.ranges import PullPlan, TransferPlan
from kvxferd.errors import KvxferdError
from kvxferd.layout import preset
from kvxferd.layout.spec import KVCacheSpec, Layout, Region


def _plain_spec(ppls: list[int], layers: int, n: int, mla: bool, heads: int) -> KVCacheSpec:
    """One attention (or MLA) group per entry of ``ppls``, ``layers`` regions each."""
    kinds = [MLA if mla else (FA if g == 0 else SWA) for g in range(len(ppls))]
    groups = [
        group(f"g{g}", kind, ppl, 4) for g, (kind, ppl) in enumerate(zip(kinds, ppls, strict=True))
    ]
    regions: list[Region] = []
    for g, ppl in enumerate(ppls):
        for i in range(layers):
            if mla:
                regions.append(mla_region(f"l{g}.{i}", g, n * ppl, kernel=4))
            else:
                regions.append(attn_region(f"l{g}.{i}", g, n * ppl, kernel=4, heads=heads))
    return spec(groups, regions)


def _same(a: PullPlan, b: PullPlan) -> None:
    assert (a.local_tp, a.remote_tp, a.tp_ratio) == (b.local_tp, b.remote_tp, b.tp_ratio)
    assert a.notify_ranks == b.notify_ranks
    assert sorted(a.per_rank) == sorted(b.per_rank)
    for x, y in zip(a.local_kernel_blocks, b.local_kernel_blocks, strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(a.remote_kernel_blocks, b.remote_kernel_blocks, strict=True):
        np.testing.assert_array_equal(x, y)
    for r in a.per_rank:
        _same_part(a.per_rank[r], b.per_rank[r])


def _same_part(p: TransferPlan, q: TransferPlan) -> None:
    assert (p.nbytes, p.num_ranges, p.naive_descriptors) == (
        q.nbytes,
        q.num_ranges,
        q.naive_descriptors,
    )
    assert len(p.classes) == len(q.classes)
    for c, d in zip(p.classes, q.classes, strict=True):
        np.testing.assert_array_equal(c.regions, d.regions)
        assert not c.regions.flags.writeable
        assert (c.ranges.region, c.ranges.name, c.ranges.coalesced) == (
            d.ranges.region,
            d.ranges.name,
            d.ranges.coalesced,
        )
        for x, y in (
            (c.ranges.local_offset, d.ranges.local_offset),
            (c.ranges.remote_offset, d.ranges.remote_offset),
            (c.ranges.length, d.ranges.length),
        ):
            np.testing.assert_array_equal(x, y)
            assert not x.flags.writeable
    for x, y in zip(p.local_kernel_blocks, q.local_kernel_blocks, strict=True):
        np.testing.assert_array_equal(x, y)
        assert not x.flags.writeable
    # the per-region view, built on demand, agrees too
    for rr, ss in zip(p.ranges, q.ranges, strict=True):
        assert (rr.region, rr.name) == (ss.region, ss.name)
        np.testing.assert_array_equal(rr.local_offset, ss.local_offset)
        np.testing.assert_array_equal(rr.length, ss.length)


def _outcome(fn: object, *args: object, **kw: object) -> PullPlan | tuple[str, str, str]:
    try:
        return fn(*args, **kw)  # type: ignore[operator,no-any-return]
    except KvxferdError as err:
        return type(err).__name__, err.field, err.message


ids = st.lists(st.integers(-2, 30), max_size=20)


@PROPS
@given(
    ppls=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    layers=st.integers(1, 3),
    mla=st.booleans(),
    prefix=st.booleans(),
    as_arrays=st.booleans(),
    data=st.data(),
)
def test_plain_route_plans_and_refuses_as_the_general_planner(
    *,
    ppls: list[int],
    layers: int,
    mla: bool,
    prefix: bool,
    as_arrays: bool,
    data: st.DataObject,
) -> None:
    n = 24
    s = _plain_spec(ppls, layers, n, mla, heads=2)
    assert route_mod.plain_route(s, s, (0, 1), (0, 1), None) is not None
    perm = st.permutations(range(n))
    # Mostly valid requests (unique, in range, local no longer than remote), sometimes not.
    remote: list[object] = []
    local: list[object] = []
    for _ in ppls:
        if data.draw(st.integers(0, 4)) == 0:
            remote.append(data.draw(ids))
            local.append(data.draw(ids))
            continue
        r = data.draw(perm)[: data.draw(st.integers(0, 12))]
        loc = data.draw(perm)[: data.draw(st.integers(0, len(r) + 1))]
        remote.append(np.array(r, dtype=np.int64) if as_arrays else r)
        local.append(np.array(loc, dtype=np.int64) if as_arrays else loc)
    if data.draw(st.integers(0, 20)) == 0:
        local = local[:-1]  # a group list missing
    got = _outcome(plan_pull, s, s, local, remote, prefix_caching=prefix)
    want = _outcome(plan_general, s, s, local, remote, prefix_caching=prefix)
    if isinstance(want, PullPlan):
        assert isinstance(got, PullPlan)
        _same(got, want)
    else:
        assert got == want


@pytest.mark.parametrize(
    ("name", "local", "remote", "local_tp", "remote_tp"),
    [
        ("dense", "dense:num_blocks=32", "dense:num_blocks=32", (0, 1), (0, 1)),
        ("dense, other pool sizes", "dense:num_blocks=32", "dense:num_blocks=48", (0, 1), (0, 1)),
        ("mla, TP 2 reads TP 1", "mla:num_blocks=32", "mla:num_blocks=32", (1, 2), (0, 1)),
        ("dense, equal TP 2", "dense:num_blocks=32", "dense:num_blocks=32", (1, 2), (1, 2)),
    ],
)
def test_plain_specs_get_a_route_that_is_kept(
    name: str, local: str, remote: str, local_tp: tuple[int, int], remote_tp: tuple[int, int]
) -> None:
    lo, re = preset(local), preset(remote)
    route = route_mod.plain_route(lo, re, local_tp, remote_tp, None)
    assert route is not None, name
    assert route_mod.plain_route(lo, re, local_tp, remote_tp, None) is route  # worked out once
    ids = np.arange(4, dtype=np.int64)
    plan = route.plan([ids], [ids + 1], 1 << 16)
    assert plan is not None
    _same(
        plan,
        plan_general(
            lo, re, [ids], [ids + 1], prefix_caching=True, local_tp=local_tp, remote_tp=remote_tp
        ),
    )


def _padded() -> KVCacheSpec:
    r = attn_region("l0", 0, 16, kernel=4)
    return spec(
        [group("g", FA, 1, 4)], [attn_region("l0", 0, 16, kernel=4, block_stride=r.block_len + 8)]
    )


@pytest.mark.parametrize(
    ("why", "local", "remote", "local_tp", "remote_tp"),
    [
        ("a Mamba state group", "hybrid:num_blocks=16", "hybrid:num_blocks=16", (0, 1), (0, 1)),
        (
            "kernel blocks per logical block differ",
            "dense:num_blocks=32,block_size=16",
            "dense:num_blocks=32,block_size=32",
            (0, 1),
            (0, 1),
        ),
        (
            "heads split across TP ranks",
            "dense:num_blocks=32,layout=HND,num_kv_heads=4",
            "dense:num_blocks=32,layout=HND,num_kv_heads=4",
            (0, 2),
            (0, 1),
        ),
    ],
)
def test_other_spec_pairs_take_the_general_path(
    why: str, local: str, remote: str, local_tp: tuple[int, int], remote_tp: tuple[int, int]
) -> None:
    try:
        lo, re = preset(local), preset(remote)
    except KvxferdError as err:  # a preset option this build does not take
        pytest.fail(f"{why}: {err}")
    assert route_mod.plain_route(lo, re, local_tp, remote_tp, None) is None, why


def test_padded_blocks_and_a_state_group_take_the_general_path() -> None:
    padded = _padded()
    assert route_mod.plain_route(padded, padded, (0, 1), (0, 1), None) is None
    mamba = spec(
        [group("g", FA, 1, 4), group("m", MAMBA, 1, 4)],
        [
            attn_region("l0", 0, 16, kernel=4),
            Region("s", 1, attn_region("x", 0, 1).dtype, Layout.STATE, (16, 8)),
        ],
    )
    assert route_mod.plain_route(mamba, mamba, (0, 1), (0, 1), None) is None


def test_the_route_memo_is_bounded_and_keyed_by_identity() -> None:
    route_mod._ROUTES.clear()
    specs = [preset(f"dense:num_blocks={8 + i}") for i in range(route_mod.MAX_ROUTES + 3)]
    for s in specs:
        assert route_mod.plain_route(s, s, (0, 1), (0, 1), None) is not None
    assert len(route_mod._ROUTES) <= route_mod.MAX_ROUTES
    a, b = preset("dense:num_blocks=8"), preset("dense:num_blocks=8")  # equal, not the same
    ra, rb = (route_mod.plain_route(x, x, (0, 1), (0, 1), None) for x in (a, b))
    assert ra is not None and rb is not None and ra is not rb
    assert ra.regions is a.regions and rb.regions is b.regions
