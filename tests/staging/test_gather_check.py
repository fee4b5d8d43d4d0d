"""Units of kvxferd.staging.gather_check: a Gather copies only kernel blocks inside the pool
and held under the request's lease."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.errors import InvalidRequest, LeaseRefused
from kvxferd.layout.presets import preset
from kvxferd.staging.gather_check import check_gather

SPEC = preset("dense:num_blocks=64")


@given(
    st.sets(st.integers(0, 63), max_size=20),
    st.lists(st.integers(-2, 70), max_size=12, unique=True),
)
def test_only_held_ids_inside_the_pool_pass(held: set[int], asked: list[int]) -> None:
    blocks = (np.array(sorted(held), dtype=np.int64),)
    ok = all(0 <= i < 64 for i in asked) and set(asked) <= held
    if ok:
        (got,) = check_gather(SPEC, blocks, "r", [asked], max_block_ids=64)
        assert got.tolist() == asked
    else:
        with pytest.raises((InvalidRequest, LeaseRefused)) as err:
            check_gather(SPEC, blocks, "r", [asked], max_block_ids=64)
        assert err.value.fix  # every refusal says what to do


def test_a_request_not_held_and_a_wrong_group_count_are_refused_with_the_field() -> None:
    with pytest.raises(LeaseRefused) as not_held:
        check_gather(SPEC, None, "gone", [[1]], max_block_ids=64)
    assert not_held.value.field == "request_id" and "gone" in str(not_held.value)
    blocks = (np.array([1, 2], dtype=np.int64),)
    with pytest.raises(InvalidRequest) as groups:
        check_gather(SPEC, blocks, "r", [[1], [2]], max_block_ids=64)
    assert groups.value.field == "kernel_block_ids.groups"
