"""The owner side's pure parts: a pull's plan turned around for a WRITE, and the bounds check
of the caller's side that runs before anything is loaded (property tests)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.blocks.ranges import RegionRanges, TransferPlan
from kvxferd.daemon.pusher import check_inside, reversed_plan
from kvxferd.errors import BlockRangeError
from kvxferd.transfer.descriptors import RegionTable, build_descriptors

SIZES = [1 << 16, 1 << 20]


@st.composite
def plans(draw: st.DrawFn) -> tuple[TransferPlan, RegionTable, RegionTable]:
    """A plan inside two sides' regions (offsets and lengths in bytes)."""
    n_regions = draw(st.integers(1, 3))
    ranges = []
    for region in range(n_regions):
        n = draw(st.integers(0, 6))
        length = np.array(draw(st.lists(st.integers(1, 4096), min_size=n, max_size=n)))
        lo = np.array([draw(st.integers(0, SIZES[0] - int(x))) for x in length])
        ro = np.array([draw(st.integers(0, SIZES[1] - int(x))) for x in length])
        ranges.append(
            RegionRanges(
                region,
                f"r{region}",
                lo.astype(np.int64),
                ro.astype(np.int64),
                length.astype(np.int64),
            )
        )
    local = RegionTable.from_array([(4096 * (i + 1) << 20, SIZES[0], 0) for i in range(n_regions)])
    remote = RegionTable.from_array([(8192 * (i + 1) << 20, SIZES[1], 0) for i in range(n_regions)])
    return TransferPlan(ranges=tuple(ranges), naive_descriptors=7), local, remote


@given(plans())
def test_reversed_plan_moves_the_same_bytes_the_other_way(
    case: tuple[TransferPlan, RegionTable, RegionTable],
) -> None:
    plan, reader, owner = case
    back = reversed_plan(plan)
    assert back.nbytes == plan.nbytes and back.naive_descriptors == plan.naive_descriptors
    # What the reader would READ (its own rows local) is what the owner WRITEs (its rows local).
    r_local, r_remote = build_descriptors(plan, reader, owner, merge=False)
    o_local, o_remote = build_descriptors(back, owner, reader, merge=False)
    assert np.array_equal(r_local, o_remote) and np.array_equal(r_remote, o_local)
    assert (
        reversed_plan(back).ranges[0].local_offset.tolist() == plan.ranges[0].local_offset.tolist()
    )
    check_inside(back, reader)  # inside the reader's regions: accepted


@given(plans(), st.integers(1, 4096))
def test_a_range_past_the_callers_region_is_refused(
    case: tuple[TransferPlan, RegionTable, RegionTable], over: int
) -> None:
    plan, reader, _ = case
    rr = plan.ranges[0]
    bad = RegionRanges(
        rr.region,
        rr.name,
        np.append(rr.local_offset, 0).astype(np.int64),
        np.append(rr.remote_offset, 0).astype(np.int64),
        np.append(rr.length, SIZES[0] + over).astype(np.int64),
    )
    with pytest.raises(BlockRangeError, match="outside the caller's registered region 'r0'"):
        check_inside(reversed_plan(TransferPlan(ranges=(bad, *plan.ranges[1:]))), reader)


def test_a_region_the_caller_did_not_register_is_refused() -> None:
    one = RegionTable.from_array([(1 << 30, 4096, 0)])
    plan = TransferPlan(
        ranges=(
            RegionRanges(
                1, "r1", np.array([0], np.int64), np.array([0], np.int64), np.array([8], np.int64)
            ),
        )
    )
    with pytest.raises(BlockRangeError, match="region 1; the caller registered 1"):
        check_inside(plan, one)
