"""plan_pull end to end: execute the plan on byte arrays and check every block's contents."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from blocks_helpers import (
    FA,
    MAMBA,
    MLA,
    PROPS,
    SWA,
    attn_region,
    execute,
    execute_all,
    group,
    mla_region,
    spec,
    state_region,
)
from hypothesis import assume, given
from hypothesis import strategies as st

from kvxferd.blocks import kv_head_range, plan_pull
from kvxferd.errors import InvalidRequest
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import KVCacheSpec, Layout, Region
from kvxferd.transfer.descriptors import coalesce

U8 = npt.NDArray[np.uint8]


def _filled(s: KVCacheSpec, seed: int) -> list[U8]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, r.nbytes, dtype=np.uint8) for r in s.regions]


def _block(buf: U8, r: Region, b: int) -> U8:
    return buf[b * r.stride : b * r.stride + r.block_len]


def _hybrid(ppl: int, n: int, *, stride_pad: int = 0) -> KVCacheSpec:
    """Full attention (fp8, 2 layers) + sliding window (bf16, 1 layer) + Mamba state."""
    n_k = n * ppl

    def attn(name: str, grp: int, dtype: KVDType, stride: int = 0) -> Region:
        return attn_region(
            name, grp, n_k, kernel=4, heads=2, head_size=4, dtype=dtype, block_stride=stride
        )

    fa0, fa1 = attn("fa.0", 0, KVDType.FP8_E4M3), attn("fa.1", 0, KVDType.FP8_E4M3)
    sw = attn("swa.0", 1, KVDType.BF16)
    if stride_pad:
        sw = attn("swa.0", 1, KVDType.BF16, sw.block_len + stride_pad)
    return spec(
        [group("fa", FA, ppl, 4), group("swa", SWA, ppl, 4), group("m", MAMBA, 1, 4)],
        [fa0, sw, state_region("ssm.0", 2, n), fa1],
    )


@PROPS
@given(st.integers(1, 4), st.integers(0, 16), st.booleans(), st.data())
def test_hybrid_tp1_moves_exactly_the_paired_blocks(
    ppl: int, pad: int, prefix: bool, data: st.DataObject
) -> None:
    n = 12
    s = _hybrid(ppl, n, stride_pad=pad)
    perm = st.permutations(range(n))
    r_ids = [data.draw(perm)[: data.draw(st.integers(0, 6))] for _ in range(2)]
    l_ids = [data.draw(perm)[: data.draw(st.integers(0, len(r)))] for r in r_ids]
    k = data.draw(st.integers(1, 3))
    ms = data.draw(perm)
    r_ids.append(ms[:k])
    l_ids.append(ms[k : k + (data.draw(st.integers(1, k)) if prefix else k)])
    plan = plan_pull(s, s, l_ids, r_ids, prefix_caching=prefix)
    assert plan.read_ranks == (0,) and plan.notify_ranks == (0,)
    tp = plan.per_rank[0]
    remote, local = _filled(s, 1), _filled(s, 2)
    before = [b.copy() for b in local]
    execute(tp, local, remote)
    for i, r in enumerate(s.regions):
        lk, rk = plan.local_kernel_blocks[r.group], plan.remote_kernel_blocks[r.group]
        for lb, rb in zip(lk.tolist(), rk.tolist(), strict=True):
            assert (_block(local[i], r, lb) == _block(remote[i], r, rb)).all()
        untouched = np.ones(r.nbytes, dtype=bool)
        for lb in lk.tolist():
            untouched[lb * r.stride : lb * r.stride + r.block_len] = False
        assert (local[i][untouched] == before[i][untouched]).all()
    assert tp.naive_descriptors == sum(
        plan.local_kernel_blocks[r.group].shape[0] for r in s.regions
    )
    assert tp.num_ranges <= tp.naive_descriptors


def test_contiguous_ids_one_range_per_region_and_cross_layer() -> None:
    n = 64
    per_layer = spec(
        [group("fa", FA, 1)], [attn_region(f"l{i}", 0, n, heads=8, head_size=8) for i in range(4)]
    )
    plan = plan_pull(per_layer, per_layer, [range(0, 32)], [range(10, 42)], prefix_caching=False)
    tp = plan.per_rank[0]
    assert tp.num_ranges == 4 and tp.naive_descriptors == 4 * 32
    assert all(rg.local_offset.tolist() == [0] for rg in tp.ranges)
    cross = spec(
        [group("fa", FA, 1)],
        [attn_region("all", 0, n, heads=8, head_size=8, layers=4, layout=Layout.CROSS_LAYER_NHD)],
    )
    rng = np.random.default_rng(0)
    ids = rng.permutation(n)[:32]
    plan = plan_pull(cross, cross, [ids], [rng.permutation(n)[:32]], prefix_caching=False)
    assert plan.per_rank[0].naive_descriptors == 32
    assert plan.nbytes == 32 * cross.regions[0].block_len


def test_full_prefix_hit_is_empty_but_notifies() -> None:
    s = _hybrid(2, 8)
    plan = plan_pull(s, s, [[], [], []], [[1, 2], [3], []], prefix_caching=True)
    assert plan.empty and plan.nbytes == 0 and plan.notify_ranks == (0,)
    assert all(rg.num_ranges == 0 for rg in plan.per_rank[0].ranges)


def test_group_count_and_region_pairing_refused() -> None:
    s = _hybrid(2, 8)
    with pytest.raises(InvalidRequest) as e:
        plan_pull(s, s, [[1], [1]], [[1], [1]], prefix_caching=False)
    assert e.value.field == "groups"
    regions = list(s.regions)
    regions[1] = Region("other", 1, KVDType.BF16, Layout.NHD, regions[1].shape)
    renamed = spec(s.groups, regions)
    with pytest.raises(InvalidRequest) as e:
        plan_pull(s, renamed, [[1], [1], [1]], [[1], [1], [1]], prefix_caching=False)
    assert e.value.field == "regions[1]"


# --- heterogeneous TP, executed on per-rank caches whose values encode (block, head, ...) ---

T, D = 2, 3  # tokens per kernel block, head size


def _rank_cache(
    rank: int, tp: int, heads: int, layers: int, n: int
) -> tuple[npt.NDArray[np.int32], int]:
    """HND cache of one rank: (blocks, layers, 2, rank_heads, T, D) int32 (fp32 bytes) whose
    values encode (block, layer, kv, global head, token, d)."""
    first, count = kv_head_range(rank, tp, heads)
    b, ly, kv, h, t, d = np.ix_(
        np.arange(n),
        np.arange(layers),
        np.arange(2),
        np.arange(first, first + count),
        np.arange(T),
        np.arange(D),
    )
    val = ((((b * layers + ly) * 2 + kv) * heads + h) * T + t) * D + d
    return val.astype(np.int32), count


def _tp_spec(count: int, layers: int, n: int) -> KVCacheSpec:
    layout = Layout.CROSS_LAYER_HND if layers > 1 else Layout.HND
    reg = attn_region(
        "kv",
        0,
        n,
        kernel=T,
        heads=count,
        head_size=D,
        layout=layout,
        layers=layers,
        dtype=KVDType.FP32,
    )
    return spec([group("fa", FA, 2, kernel=T)], [reg])


@PROPS
@given(st.integers(1, 4), st.integers(0, 16), st.booleans(), st.data())
def test_ranges_marked_coalesced_are_what_coalescing_gives(
    ppl: int, pad: int, prefix: bool, data: st.DataObject
) -> None:
    """RegionRanges.coalesced (the planner's whole-block runs, whose coalescing DIRECT and
    KERNEL skip): sorted by local offset, and coalescing them changes nothing; the hybrid
    preset with and without padded strides, so that both kinds of region are planned."""
    n = 12
    s = _hybrid(ppl, n, stride_pad=pad)
    perm = st.permutations(range(n))
    r_ids = [data.draw(perm)[: data.draw(st.integers(0, 8))] for _ in range(2)]
    l_ids = [data.draw(perm)[: len(r)] for r in r_ids]
    r_ids.append([data.draw(st.integers(0, n - 1))])
    l_ids.append([data.draw(st.integers(0, n - 1))])
    tp = plan_pull(s, s, l_ids, r_ids, prefix_caching=prefix).per_rank[0]
    marked = [rr for rr in tp.ranges if rr.coalesced]
    if pad == 0 and any(len(r) for r in r_ids[:2]):
        assert marked  # an attention region with whole, unpadded blocks was planned
    for rr in marked:
        got = coalesce(rr.local_offset, rr.remote_offset, rr.length)
        for a, b in zip(got, (rr.local_offset, rr.remote_offset, rr.length), strict=True):
            np.testing.assert_array_equal(a, b)


@PROPS
@given(
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2, 4, 8, 16]),
    st.sampled_from([1, 2, 4, 8, 16]),
    st.integers(1, 2),
    st.data(),
)
def test_hetero_tp_every_local_rank_gets_its_heads(
    heads: int, lt: int, rt: int, layers: int, data: st.DataObject
) -> None:
    assume(max(lt, rt) % min(lt, rt) == 0)
    n = 8  # kernel blocks; ppl 2 -> 4 logical
    remote_caches = {r: _rank_cache(r, rt, heads, layers, n) for r in range(rt)}
    remote_spec = _tp_spec(remote_caches[0][1], layers, n)
    r_ids = data.draw(st.permutations(range(4)))[: data.draw(st.integers(0, 4))]
    l_ids = data.draw(st.permutations(range(4)))[: len(r_ids)]
    notified = np.zeros(rt, dtype=np.int64)
    for lr in range(lt):
        want, count = _rank_cache(lr, lt, heads, layers, n)
        local_spec = _tp_spec(count, layers, n)
        plan = plan_pull(
            local_spec,
            remote_spec,
            [l_ids],
            [r_ids],
            prefix_caching=False,
            local_tp=(lr, lt),
            remote_tp=(0, rt),
        )
        buf = np.full(want.shape, -1, dtype=np.int32)
        execute_all(
            plan.per_rank,
            [buf.reshape(-1).view(np.uint8)],
            {r: [c.reshape(-1).view(np.uint8)] for r, (c, _) in remote_caches.items()},
        )
        lk, rk = plan.local_kernel_blocks[0], plan.remote_kernel_blocks[0]
        # values encode the *remote* block ID and the global head: paired local block lk[i]
        # must hold remote block rk[i]'s data for exactly this rank's heads
        assert (buf[lk] == want[rk]).all()
        unpaired = np.setdiff1d(np.arange(n), lk)
        assert (buf[unpaired] == -1).all()
        notified[list(plan.notify_ranks)] += 1
        if lt <= heads and rt <= heads:
            assert len(plan.read_ranks) == max(1, rt // lt)
    assert (notified >= 1).all()  # every prefill rank hears from someone


def test_mla_hetero_tp_reads_one_rank_notifies_all() -> None:
    n = 8
    s = spec([group("mla", MLA, 2, kernel=16)], [mla_region("m", 0, n)])
    notified: set[int] = set()
    for lr in range(2):
        plan = plan_pull(
            s, s, [[1, 2]], [[0, 3]], prefix_caching=False, local_tp=(lr, 2), remote_tp=(0, 8)
        )
        assert plan.read_ranks == (lr,) and plan.tp_ratio == -4
        assert plan.per_rank[lr].num_ranges == 2
        notified.update(plan.notify_ranks)
    assert notified == set(range(8))


def test_nemotron_style_hybrid_4p1d() -> None:
    """Prefill TP 4, decode TP 1 (tp_ratio -4), remote ppl 34 vs local 66: attention heads from
    four ranks (HND), the replicated Mamba state whole from rank 0, remote IDs expanded with the
    remote's ppl."""
    kernel, heads = 16, 8

    def mk(ppl: int, rank_heads: int, n_logical: int) -> KVCacheSpec:
        attn = attn_region(
            "attn",
            0,
            n_logical * ppl,
            kernel=kernel,
            heads=rank_heads,
            head_size=4,
            layout=Layout.HND,
        )
        return spec(
            [group("fa", FA, ppl, kernel), group("m", MAMBA, 1, kernel)],
            [attn, state_region("ssm", 1, 6)],
        )

    remote, local = mk(34, heads // 4, 8), mk(66, heads, 4)
    plan = plan_pull(
        local, remote, [[1, 3], [5]], [[5, 6], [2]], prefix_caching=False, remote_tp=(0, 4)
    )
    assert plan.tp_ratio == -4 and plan.read_ranks == (0, 1, 2, 3)
    assert plan.remote_kernel_blocks[0].tolist() == list(range(170, 238))
    for r, tp in plan.per_rank.items():
        attn, ssm = tp.ranges
        assert attn.num_ranges == 68 * 2  # K and V head slices per kernel block
        assert ssm.num_ranges == (1 if r == 0 else 0)
        assert tp.local_kernel_blocks[1].tolist() == ([5] if r == 0 else [])
    with pytest.raises(InvalidRequest, match="prefix caching"):
        plan_pull(
            local, remote, [[1, 3], [5]], [[5, 6], [2]], prefix_caching=True, remote_tp=(0, 4)
        )
