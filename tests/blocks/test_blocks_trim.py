"""Pairing/trimming: docs/domain.md §5 worked example and position-alignment properties.

Each side gets a "cache": an array indexed by kernel block ID whose value is the first token
position that kernel block holds. After pairing, paired blocks must hold the same positions.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from blocks_helpers import FA, MAMBA, PROPS, SWA, group
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.blocks import logical_to_kernel, pair_group
from kvxferd.errors import InvalidRequest, SpecError

KB = 64  # kernel block size (tokens) of the §5 example


def position_cache(
    logical_ids: list[int], ppl: int, num_kernel: int, first_token: int = 0
) -> npt.NDArray[np.int64]:
    """Kernel block k of the i-th listed logical block holds tokens from (i*ppl + j)*KB on."""
    cache = np.full(num_kernel, -1, dtype=np.int64)
    kernel = logical_to_kernel(logical_ids, ppl)
    cache[kernel] = first_token + np.arange(kernel.shape[0]) * KB
    return cache


def test_worked_example_640_tokens_ppl_10_vs_6() -> None:
    """640 tokens: ppl 10 -> 1 logical = 10 kernel blocks; ppl 6 -> 2 logical = 12.

    Both keep kernel blocks covering tokens 0..639 (10 each). Keeping each side's last logical
    blocks instead would pair tokens 384..767 of the ppl-6 side with 0..639.
    """
    g10, g6 = group("fa", FA, 10, kernel=KB), group("fa", FA, 6, kernel=KB)
    local_ids, remote_ids = [3], [7, 2]  # local ppl 10, remote ppl 6
    lk, rk = pair_group(g10, g6, local_ids, remote_ids, prefix_caching=False)
    assert lk.shape == rk.shape == (10,)
    assert lk.tolist() == list(range(30, 40))
    assert rk.tolist() == [*range(42, 48), 12, 13, 14, 15]
    lc = position_cache(local_ids, 10, 40)
    rc = position_cache(remote_ids, 6, 48)
    assert (lc[lk] == rc[rk]).all()
    assert lc[lk].tolist() == [t * KB for t in range(10)]  # tokens 0..639
    # and the other direction (local has the smaller ppl)
    lk2, rk2 = pair_group(g6, g10, remote_ids, local_ids, prefix_caching=False)
    assert (rc[lk2] == lc[rk2]).all() and lk2.shape == (10,)


def test_ppl_mismatch_with_prefix_caching_is_refused_naming_both() -> None:
    g10, g6 = group("fa", FA, 10, kernel=KB), group("fa", FA, 6, kernel=KB)
    with pytest.raises(InvalidRequest) as e:
        pair_group(g10, g6, [0], [0, 1], prefix_caching=True, field="groups[0]")
    assert "10" in e.value.message and "6" in e.value.message
    assert "prefix caching" in e.value.fix and e.value.field == "groups[0]"


def test_ppl_mismatch_too_far_apart_is_refused() -> None:
    g10, g6 = group("fa", FA, 10, kernel=KB), group("fa", FA, 6, kernel=KB)
    # 10 vs 18 kernel blocks: differ by 8 < 10, fine; 10 vs 24 differ by 14: refused
    pair_group(g10, g6, [0], [0, 1, 2], prefix_caching=False)
    with pytest.raises(InvalidRequest):
        pair_group(g10, g6, [0], [0, 1, 2, 3], prefix_caching=False)


def test_kernel_block_sizes_must_match() -> None:
    a, b = group("fa", FA, 4, kernel=16), group("fa", FA, 2, kernel=32)
    with pytest.raises(SpecError, match="kernel block sizes differ"):
        pair_group(a, b, [0], [0], prefix_caching=False)


def test_group_kinds_must_match() -> None:
    with pytest.raises(SpecError):
        pair_group(group("a", FA, 2), group("a", SWA, 2), [0], [0], prefix_caching=False)


def test_end_trim_prefix_caching() -> None:
    g = group("fa", FA, 2)
    lk, rk = pair_group(g, g, [8, 9], [1, 2, 3, 4], prefix_caching=True)
    assert lk.tolist() == [16, 17, 18, 19] and rk.tolist() == [6, 7, 8, 9]
    with pytest.raises(InvalidRequest) as e:
        pair_group(g, g, [1, 2, 3], [1, 2], prefix_caching=True, field="groups[2]")
    assert e.value.field == "groups[2].local_block_ids"


def test_full_prefix_hit_pairs_nothing() -> None:
    g = group("fa", FA, 3)
    lk, rk = pair_group(g, g, [], [1, 2, 3], prefix_caching=True)
    assert lk.shape == rk.shape == (0,)  # not arr[-0:], which is everything


def test_state_groups() -> None:
    m = group("m", MAMBA, 66)
    lk, rk = pair_group(m, m, [4, 1], [2, 9], prefix_caching=False)
    assert lk.tolist() == [4, 1] and rk.tolist() == [2, 9]
    lk, rk = pair_group(m, m, [4], [2, 9, 7], prefix_caching=True)
    assert lk.tolist() == [4] and rk.tolist() == [7]  # the latest remote state
    with pytest.raises(InvalidRequest):
        pair_group(m, m, [4], [2, 9], prefix_caching=False)
    with pytest.raises(InvalidRequest):
        pair_group(m, m, [4, 5, 6], [2, 9], prefix_caching=True)


@st.composite
def _ids(draw: st.DrawFn, n: int) -> list[int]:
    return draw(st.permutations(range(n + draw(st.integers(0, 5)))))[:n]


@PROPS
@given(
    st.integers(1, 12),
    st.integers(1, 12),
    st.integers(1, 2000),
    st.data(),
)
def test_ppl_mismatch_keeps_token_positions(
    ppl_l: int, ppl_r: int, tokens: int, data: st.DataObject
) -> None:
    """Prefix caching off, both sides start at token 0: pairs hold equal token positions and
    cover the whole prompt."""
    n_l = -(-tokens // (ppl_l * KB))
    n_r = -(-tokens // (ppl_r * KB))
    lids, rids = data.draw(_ids(n_l)), data.draw(_ids(n_r))
    gl, gr = group("fa", FA, ppl_l, kernel=KB), group("fa", FA, ppl_r, kernel=KB)
    lk, rk = pair_group(gl, gr, lids, rids, prefix_caching=False)
    lc = position_cache(lids, ppl_l, (max(lids) + 1) * ppl_l)
    rc = position_cache(rids, ppl_r, (max(rids) + 1) * ppl_r)
    assert lk.shape == rk.shape
    assert (lc[lk] == rc[rk]).all()
    assert sorted(lc[lk].tolist()) == [t * KB for t in range(lk.shape[0])]
    assert lk.shape[0] * KB >= tokens  # every prompt token is moved


@PROPS
@given(st.integers(1, 8), st.integers(0, 30), st.integers(0, 30), st.data())
def test_end_trim_keeps_token_positions(
    ppl: int, cached: int, tail: int, data: st.DataObject
) -> None:
    """Prefix caching on: the local side holds logical blocks [cached, cached+tail) of the
    prompt; the remote lists all of them. Pairs hold equal token positions."""
    n_r = cached + tail
    rids = data.draw(_ids(n_r))
    lids = data.draw(_ids(tail))
    g = group("fa", FA, ppl, kernel=KB)
    lk, rk = pair_group(g, g, lids, rids, prefix_caching=True)
    rc = position_cache(rids, ppl, (max(rids, default=0) + 1) * ppl)
    lc = position_cache(lids, ppl, (max(lids, default=0) + 1) * ppl, first_token=cached * ppl * KB)
    assert lk.shape == rk.shape == (tail * ppl,)
    assert (lc[lk] == rc[rk]).all()
