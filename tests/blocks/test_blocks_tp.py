"""Heterogeneous TP: ratios, head ownership, dedup, segments and their coverage."""

from __future__ import annotations

import numpy as np
import pytest
from blocks_helpers import PROPS, attn_region, mla_region, state_region
from hypothesis import assume, given
from hypothesis import strategies as st

from kvxferd.blocks import (
    head_sources,
    infer_num_kv_heads,
    kv_head_range,
    region_segments,
    tp_ratio,
)
from kvxferd.blocks.tp import HeadSource
from kvxferd.errors import InvalidRequest
from kvxferd.layout.spec import Layout, Region

HEADS = st.sampled_from([1, 2, 4, 8])
TPS = st.sampled_from([1, 2, 4, 8, 16])


@pytest.mark.parametrize(
    ("local", "remote", "want"), [(4, 1, 4), (1, 4, -4), (2, 2, 1), (8, 2, 4), (2, 8, -4)]
)
def test_tp_ratio(local: int, remote: int, want: int) -> None:
    assert tp_ratio(local, remote) == want


@pytest.mark.parametrize(("local", "remote"), [(3, 2), (2, 3), (0, 1), (4, 6)])
def test_tp_ratio_refuses(local: int, remote: int) -> None:
    with pytest.raises(InvalidRequest):
        tp_ratio(local, remote)


def test_kv_head_range() -> None:
    assert [kv_head_range(r, 4, 8) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [kv_head_range(r, 16, 8)[0] for r in range(16)] == [r // 2 for r in range(16)]
    assert kv_head_range(0, 1, 8) == (0, 8)
    for bad in [(0, 4, 6), (0, 12, 8), (4, 4, 8)]:
        with pytest.raises(InvalidRequest):
            kv_head_range(*bad)


def test_head_sources_and_dedup() -> None:
    # prefill TP 4, decode TP 1: four remote ranks, two heads each
    assert head_sources(0, 1, 4, 8) == tuple(HeadSource(r, 2 * r, 2) for r in range(4))
    # decode TP 4, prefill TP 2: one remote rank, half of its heads
    assert head_sources(3, 4, 2, 8) == (HeadSource(1, 6, 2),)
    # prefill TP 16 replicates 8 heads twice: decode TP 2 reads each head once (4 ranks, not 8)
    assert head_sources(0, 2, 16, 8) == tuple(HeadSource(2 * h, h, 1) for h in range(4))
    assert head_sources(1, 2, 16, 8) == tuple(HeadSource(2 * h + 1, h, 1) for h in range(4, 8))


def test_infer_num_kv_heads() -> None:
    assert infer_num_kv_heads(2, 4, 8, 1) == 8
    assert infer_num_kv_heads(1, 16, 2, 4) == 8  # local replicates
    with pytest.raises(InvalidRequest):
        infer_num_kv_heads(2, 4, 4, 1)


def _attn(heads: int, layout: Layout, layers: int = 1) -> Region:
    return attn_region("a", 0, 4, heads=heads, layout=layout, layers=layers, kernel=2, head_size=3)


def test_equal_tp_reads_whole_block_nhd() -> None:
    r = _attn(4, Layout.NHD)
    (seg,) = region_segments(r, r, local_tp=(1, 2), remote_tp=(0, 2))
    assert seg.whole_block and seg.remote_rank == 1 and seg.length.tolist() == [r.block_len]


def test_nhd_refuses_head_slicing() -> None:
    local, remote = _attn(2, Layout.NHD), _attn(4, Layout.NHD)
    with pytest.raises(InvalidRequest) as e:
        region_segments(local, remote, local_tp=(0, 2), remote_tp=(0, 1))
    assert "HND" in e.value.fix


def test_hnd_decode_more_ranks_two_segments() -> None:
    local, remote = _attn(2, Layout.HND), _attn(4, Layout.HND)
    head = 2 * 3 * 2  # tokens * head_size * bf16
    (seg,) = region_segments(local, remote, local_tp=(1, 2), remote_tp=(0, 1))
    assert seg.remote_rank == 0 and not seg.whole_block
    assert seg.local_offset.tolist() == [0, 2 * head]
    assert seg.remote_offset.tolist() == [2 * head, 4 * head + 2 * head]
    assert seg.length.tolist() == [2 * head, 2 * head]


def test_mla_reads_one_rank_whole_block() -> None:
    r = mla_region("m", 0, 4)
    segs = [region_segments(r, r, local_tp=(lr, 2), remote_tp=(0, 8)) for lr in range(2)]
    assert [s[0].remote_rank for s in segs] == [0, 1]
    assert all(len(s) == 1 and s[0].whole_block for s in segs)
    segs = [region_segments(r, r, local_tp=(lr, 8), remote_tp=(0, 2)) for lr in range(8)]
    assert [s[0].remote_rank for s in segs] == [0, 1] * 4


def test_state_whole_block_rule() -> None:
    r = state_region("s", 0, 4)
    got = [region_segments(r, r, local_tp=(lr, 4), remote_tp=(0, 2))[0] for lr in range(4)]
    assert [s.remote_rank for s in got] == [0, 0, 1, 1]
    assert [region_segments(r, r, local_tp=(0, 1), remote_tp=(0, 4))[0].remote_rank] == [0]
    with pytest.raises(InvalidRequest, match="block length"):
        region_segments(state_region("s", 0, 4, 8), state_region("s", 0, 4, 16))


def test_layout_mismatch_refused() -> None:
    with pytest.raises(InvalidRequest, match="layout"):
        region_segments(_attn(2, Layout.NHD), _attn(2, Layout.HND))


@st.composite
def _tp_case(draw: st.DrawFn) -> tuple[int, int, int, int, Layout]:
    heads, lt, rt = draw(HEADS), draw(TPS), draw(TPS)
    assume(max(lt, rt) % min(lt, rt) == 0)
    layers = draw(st.integers(1, 3))
    layout = Layout.HND if layers == 1 else Layout.CROSS_LAYER_HND
    return heads, lt, rt, layers, layout


def _regions(heads: int, lt: int, rt: int, layers: int, layout: Layout) -> tuple[Region, Region]:
    lh, rh = kv_head_range(0, lt, heads)[1], kv_head_range(0, rt, heads)[1]
    return _attn(lh, layout, layers), _attn(rh, layout, layers)


@PROPS
@given(_tp_case())
def test_every_local_block_is_written_exactly_once(case: tuple[int, int, int, int, Layout]) -> None:
    """Any TP pair (tp_ratio < 0 reads several ranks): each local block byte written once."""
    heads, lt, rt, layers, layout = case
    local, remote = _regions(heads, lt, rt, layers, layout)
    for lr in range(lt):
        cover = np.zeros(local.block_len, dtype=np.int64)
        segs = region_segments(local, remote, local_tp=(lr, lt), remote_tp=(0, rt))
        if tp_ratio(lt, rt) < 0 and rt <= heads:
            assert len(segs) == rt // lt  # |tp_ratio| ranks without replication
        for s in segs:
            assert 0 <= s.remote_rank < rt
            for lo, ro, n in zip(s.local_offset, s.remote_offset, s.length, strict=True):
                cover[lo : lo + n] += 1
                assert ro >= 0 and ro + n <= remote.block_len
        assert (cover == 1).all()


@st.composite
def _covering_case(draw: st.DrawFn) -> tuple[int, int, int, int, Layout]:
    """A :func:`_tp_case` with tp_ratio >= 1 and no replication (rt <= lt <= heads), drawn
    directly rather than filtered (filtering tripped Hypothesis's health check)."""
    heads = draw(HEADS)
    lt = draw(TPS.filter(lambda t: t <= heads))
    rt = draw(TPS.filter(lambda t: t <= lt))
    layers = draw(st.integers(1, 3))
    layout = Layout.HND if layers == 1 else Layout.CROSS_LAYER_HND
    return heads, lt, rt, layers, layout


@PROPS
@given(_covering_case())
def test_remote_blocks_covered_exactly_once_over_local_ranks(
    case: tuple[int, int, int, int, Layout],
) -> None:
    """tp_ratio >= 1 without replication: all local ranks together read every byte of every
    remote rank's block exactly once."""
    heads, lt, rt, layers, layout = case
    assert lt >= rt and lt <= heads
    local, remote = _regions(heads, lt, rt, layers, layout)
    cover = np.zeros((rt, remote.block_len), dtype=np.int64)
    for lr in range(lt):
        for s in region_segments(local, remote, local_tp=(lr, lt), remote_tp=(0, rt)):
            for ro, n in zip(s.remote_offset, s.length, strict=True):
                cover[s.remote_rank, ro : ro + n] += 1
    assert (cover == 1).all()
