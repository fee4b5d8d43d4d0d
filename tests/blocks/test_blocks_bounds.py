"""Block-ID validation: every bad ID is refused, named, and refused before any range exists."""

from __future__ import annotations

import numpy as np
import pytest
from blocks_helpers import FA, MAMBA, PROPS, attn_region, group, spec, state_region
from hypothesis import given
from hypothesis import strategies as st

import kvxferd.blocks.plan as plan_mod
from kvxferd.blocks import check_block_ids, plan_pull
from kvxferd.blocks.coalesce import find_runs as orig_runs
from kvxferd.blocks.trim import pair_group as orig_pair
from kvxferd.errors import BlockRangeError, InvalidRequest

F = "groups[1].remote_block_ids"


def test_valid_ids_come_back_as_int64() -> None:
    out = check_block_ids([3, 0, 7], 8, F)
    assert out.dtype == np.int64 and out.tolist() == [3, 0, 7]
    assert check_block_ids(np.array([1, 2], dtype=np.uint16), 3, F).tolist() == [1, 2]
    assert check_block_ids([np.int32(2)], 3, F).tolist() == [2]
    assert check_block_ids([], 0, F).tolist() == []


def test_out_of_range_names_index_value_and_count() -> None:
    with pytest.raises(BlockRangeError) as e:
        check_block_ids([0, 1, 2, 9, 5, 12], 8, F)
    err = e.value
    assert err.field == "groups[1].remote_block_ids[3]"
    assert "9" in err.message and "index 3" in err.message and "2 of 6" in err.message
    assert err.fix


def test_negative() -> None:
    with pytest.raises(BlockRangeError) as e:
        check_block_ids([0, -1], 8, F)
    assert e.value.field == f"{F}[1]" and "negative" in e.value.message


def test_duplicate_names_the_repeat() -> None:
    with pytest.raises(BlockRangeError) as e:
        check_block_ids([4, 1, 2, 1, 4, 4], 8, F)
    assert e.value.field == f"{F}[3]"
    assert "repeats index 1" in e.value.message and "3 of 6" in e.value.message


@pytest.mark.parametrize(
    "ids",
    [[1, 2.0], [1, True], ["1"], [None], np.array([1.0, 2.0]), np.array([True]), [1 << 70]],
)
def test_non_integers_refused(ids: object) -> None:
    with pytest.raises(BlockRangeError):
        check_block_ids(ids, 8, F)


@pytest.mark.parametrize("ids", [5, "12", np.zeros((2, 2), dtype=np.int64)])
def test_not_a_list(ids: object) -> None:
    with pytest.raises(InvalidRequest):
        check_block_ids(ids, 8, F)


def test_length_cap_is_invalid_request_not_block_range() -> None:
    with pytest.raises(InvalidRequest) as e:
        check_block_ids(list(range(11)), 100, F, max_ids=10)
    assert not isinstance(e.value, BlockRangeError)
    assert e.value.field == F and "10" in e.value.message


def _bad_lists(num_blocks: int) -> st.SearchStrategy[tuple[list[int], int]]:
    """A list of distinct valid IDs with one bad ID inserted; returns (ids, bad index)."""

    @st.composite
    def build(draw: st.DrawFn) -> tuple[list[int], int]:
        good = draw(st.lists(st.integers(0, num_blocks - 1), unique=True, max_size=20))
        kind = draw(st.sampled_from(["neg", "high", "dup"]))
        if kind == "dup" and not good:
            kind = "high"
        if kind == "neg":
            bad = draw(st.integers(-(1 << 40), -1))
        elif kind == "high":
            bad = draw(st.integers(num_blocks, 1 << 40))
        else:
            bad = draw(st.sampled_from(good))
        lo = good.index(bad) + 1 if kind == "dup" else 0
        at = draw(st.integers(lo, len(good)))
        return [*good[:at], bad, *good[at:]], at

    return build()


@PROPS
@given(st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), _bad_lists(n))))
def test_every_bad_id_is_refused(case: tuple[int, tuple[list[int], int]]) -> None:
    n, (ids, at) = case
    with pytest.raises(BlockRangeError) as e:
        check_block_ids(ids, n, F)
    assert e.value.field == f"{F}[{at}]"


@PROPS
@given(
    st.integers(0, 1),
    st.sampled_from(["local", "remote"]),
    st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), _bad_lists(n))),
)
def test_plan_refuses_before_any_range(
    g: int, side: str, case: tuple[int, tuple[list[int], int]]
) -> None:
    """A bad ID in any group on either side is refused before pairing or coalescing runs."""
    n, (bad_ids, at) = case
    ppl = 4
    s = spec(
        [group("fa", FA, ppl), group("m", MAMBA, 1)],
        [attn_region("a0", 0, n * ppl), attn_region("a1", 0, n * ppl), state_region("s", 1, n)],
    )
    ids: list[list[int]] = [[0], [0]]
    other: list[list[int]] = [[0], [0]]
    ids[g] = bad_ids
    other[g] = list(range(len(bad_ids)))[:n]
    local, remote = (ids, other) if side == "local" else (other, ids)
    calls: list[str] = []

    def spy_pair(*a: object, **k: object) -> object:
        calls.append("pair")
        return orig_pair(*a, **k)  # type: ignore[arg-type]

    def spy_runs(*a: object, **k: object) -> object:
        calls.append("runs")
        return orig_runs(*a, **k)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_mod, "pair_group", spy_pair)
        mp.setattr(plan_mod, "find_runs", spy_runs)
        with pytest.raises(BlockRangeError) as e:
            plan_pull(s, s, local, remote, prefix_caching=False)
    assert calls == []
    assert e.value.field == f"groups[{g}].{side}_block_ids[{at}]"


def test_plan_bounds_use_each_sides_logical_count() -> None:
    """Remote logical IDs are bounded by the remote's logical count (its own ppl)."""
    remote = spec([group("fa", FA, 2)], [attn_region("a", 0, 20)])  # 10 logical
    local = spec([group("fa", FA, 4)], [attn_region("a", 0, 20)])  # 5 logical
    plan_pull(local, remote, [[4, 3]], [[9, 8, 7, 6]], prefix_caching=False)
    with pytest.raises(BlockRangeError) as e:
        plan_pull(local, remote, [[5, 3]], [[9, 8, 7, 6]], prefix_caching=False)
    assert e.value.field == "groups[0].local_block_ids[0]"
    with pytest.raises(BlockRangeError) as e:
        plan_pull(local, remote, [[4, 3]], [[10, 8, 7, 6]], prefix_caching=False)
    assert e.value.field == "groups[0].remote_block_ids[0]"


def test_max_ids_applies_in_plan() -> None:
    s = spec([group("fa", FA, 1)], [attn_region("a", 0, 64)])
    with pytest.raises(InvalidRequest) as e:
        plan_pull(s, s, [list(range(9))], [list(range(9))], prefix_caching=False, max_ids=8)
    assert e.value.field == "groups[0].local_block_ids"


def test_duplicates_found_without_a_mask_for_huge_counts() -> None:
    """A registered count too large for the duplicate mask takes the sorting path."""
    big = 1 << 40
    assert check_block_ids([big - 1, 0, 5], big, F).tolist() == [big - 1, 0, 5]
    with pytest.raises(BlockRangeError) as e:
        check_block_ids([big - 1, 7, big - 1], big, F)
    assert e.value.field == f"{F}[2]"
