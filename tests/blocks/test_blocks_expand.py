"""Logical <-> kernel expansion: docs/domain.md §4 worked examples, round-trip property."""

from __future__ import annotations

import numpy as np
import pytest
from blocks_helpers import FA, MAMBA, PROPS, SWA, attn_region, group, spec, state_region
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.blocks import expand_group, kernel_to_logical, logical_to_kernel, plan_pull
from kvxferd.blocks.expand import logical_blocks_of
from kvxferd.errors import InvalidRequest, SpecError


def test_logical_to_kernel_basic() -> None:
    assert logical_to_kernel([0, 1, 2], 2).tolist() == [0, 1, 2, 3, 4, 5]
    assert logical_to_kernel([3, 4], 2).tolist() == [6, 7, 8, 9]
    assert logical_to_kernel([5, 0], 3).tolist() == [15, 16, 17, 0, 1, 2]
    assert logical_to_kernel([], 7).tolist() == []
    out = logical_to_kernel(np.array([4], dtype=np.int32), 1)
    assert out.dtype == np.int64 and out.tolist() == [4]


def test_bad_ppl_is_a_spec_error() -> None:
    with pytest.raises(SpecError):
        logical_to_kernel([1], 0)


def test_worked_example_fa_swa_ppl_2() -> None:
    """docs/domain.md §4, row 1: full attn + sliding window, ppl 2/2: [0,1,2], [3,4] -> [0..5],
    [6..9]."""
    fa, swa = group("fa", FA, 2), group("swa", SWA, 2)
    assert expand_group(fa, [0, 1, 2]).tolist() == list(range(6))
    assert expand_group(swa, [3, 4]).tolist() == list(range(6, 10))
    s = spec([fa, swa], [attn_region("l0", 0, 20), attn_region("l1", 1, 20)])
    plan = plan_pull(s, s, [[7, 8, 9], [1, 2]], [[0, 1, 2], [3, 4]], prefix_caching=True)
    assert [a.tolist() for a in plan.remote_kernel_blocks] == [list(range(6)), list(range(6, 10))]
    assert [a.tolist() for a in plan.local_kernel_blocks] == [list(range(14, 20)), [2, 3, 4, 5]]


def test_worked_example_fa_mamba_remote_34_local_66() -> None:
    """docs/domain.md §4, row 2: remote ppl 34, local ppl 66: [5,6], [2] -> [170..237], [2].

    Expanding the remote IDs with the local ppl (the bug §4 warns about) would give 330..461.
    """
    r_fa, l_fa = group("fa", FA, 34), group("fa", FA, 66)
    mamba = group("mamba", MAMBA, 66)
    assert expand_group(r_fa, [5, 6]).tolist() == list(range(170, 238))
    assert expand_group(mamba, [2]).tolist() == [2]
    remote = spec([r_fa, mamba], [attn_region("attn", 0, 34 * 8), state_region("ssm", 1, 8)])
    local = spec([l_fa, mamba], [attn_region("attn", 0, 66 * 4), state_region("ssm", 1, 8)])
    # 2 local logical blocks = 132 kernel blocks vs 68 remote: within one logical block, so
    # the first 68 of each pair (same token positions 0..1087).
    plan = plan_pull(local, remote, [[1, 3], [5]], [[5, 6], [2]], prefix_caching=False)
    assert plan.remote_kernel_blocks[0].tolist() == list(range(170, 238))
    assert plan.local_kernel_blocks[0].tolist() == [*range(66, 132), 198, 199]
    assert plan.remote_kernel_blocks[1].tolist() == [2]
    assert plan.local_kernel_blocks[1].tolist() == [5]


def test_ratio_261() -> None:
    """Real deployments see ppl up to 261; remote IDs use the remote's 261."""
    r_fa, l_fa = group("fa", FA, 261, kernel=16), group("fa", FA, 87, kernel=16)
    assert expand_group(r_fa, [3, 1]).tolist() == list(range(783, 1044)) + list(range(261, 522))
    remote = spec([r_fa], [attn_region("a", 0, 261 * 4)])
    local = spec([l_fa], [attn_region("a", 0, 87 * 12)])
    plan = plan_pull(local, remote, [[0, 5, 11]], [[3]], prefix_caching=False)
    assert plan.remote_kernel_blocks[0].tolist() == list(range(783, 1044))
    want = list(range(0, 87)) + list(range(435, 522)) + list(range(957, 1044))
    assert plan.local_kernel_blocks[0].tolist() == want


def test_state_group_is_never_expanded() -> None:
    mamba = group("m", MAMBA, 66)
    assert mamba.ppl == 1
    assert expand_group(mamba, [9, 2, 4]).tolist() == [9, 2, 4]


@PROPS
@given(
    st.integers(1, 300),
    st.lists(st.integers(0, 10_000), unique=True, max_size=40),
)
def test_expand_collapse_round_trip(ppl: int, ids: list[int]) -> None:
    k = logical_to_kernel(ids, ppl)
    assert k.shape == (len(ids) * ppl,)
    assert len(set(k.tolist())) == k.shape[0]
    assert kernel_to_logical(k, ppl).tolist() == ids
    # every kernel ID maps back to its logical block
    assert (k // ppl).tolist() == [i for i in ids for _ in range(ppl)]


@PROPS
@given(
    st.integers(2, 50),
    st.lists(st.integers(0, 1000), unique=True, min_size=1, max_size=10),
    st.data(),
)
def test_collapse_refuses_partial_blocks(ppl: int, ids: list[int], data: st.DataObject) -> None:
    k = logical_to_kernel(ids, ppl)
    how = data.draw(st.sampled_from(["drop", "shift", "swap"]))
    if how == "drop":
        i = data.draw(st.integers(0, k.shape[0] - 1))
        bad = np.delete(k, i)
    elif how == "shift":
        bad = k + 1
    else:
        j = data.draw(st.integers(0, len(ids) - 1))
        bad = k.copy()
        bad[j * ppl], bad[j * ppl + 1] = bad[j * ppl + 1], bad[j * ppl]
    with pytest.raises(InvalidRequest):
        kernel_to_logical(bad, ppl)


def test_logical_blocks_of_kernel_ids_name_each_logical_block_once_in_first_order() -> None:
    # A failed pull's undefined kernel blocks, reported as the logical IDs its caller sent.
    assert logical_blocks_of([14, 15, 2, 3, 4, 5], 2).tolist() == [7, 1, 2]
    assert logical_blocks_of([15, 3], 2).tolist() == [7, 1]  # a partly written block counts
    assert logical_blocks_of([9, 4, 9], 1).tolist() == [9, 4]
    assert logical_blocks_of([], 4).tolist() == []


@given(
    st.lists(st.integers(0, 10_000), unique=True, max_size=40),
    st.integers(1, 8),
)
def test_logical_blocks_of_inverts_the_expansion(ids: list[int], ppl: int) -> None:
    kernel = logical_to_kernel(ids, ppl)
    assert logical_blocks_of(kernel, ppl).tolist() == ids
    assert logical_blocks_of(kernel[::-1], ppl).tolist() == ids[::-1]
