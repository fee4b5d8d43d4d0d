"""Range copies on CPU: regions checked once (:class:`Regions`) give the same checks, table and
bytes as plain tensor lists, and bad regions or pieces are refused before anything is copied."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.blocks.ranges import RegionRanges, TransferPlan
from kvxferd.errors import BlockRangeError, InvalidRequest
from kvxferd.kernels import GroupCopy, RangeCopy, Regions, copy_groups, copy_ranges, twin
from kvxferd.kernels.ranges import (
    SMALL,
    CheckedCopy,
    address_table,
    check_groups,
    check_ranges,
    extent,
    group_table,
    lo_hi,
)
from kvxferd.transfer.descriptors import RegionTable, build_descriptors

SIZES = [4096, 1000, 2048]


def _regions(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in SIZES]


@st.composite
def copies(draw: st.DrawFn) -> RangeCopy:
    """Pieces inside the regions, destinations not overlapping within a region."""
    cols: list[list[int]] = [[], [], [], []]
    for r, size in enumerate(SIZES):
        slots = draw(st.lists(st.integers(0, size // 100 - 1), max_size=6, unique=True))
        for slot in slots:
            n = draw(st.integers(1, 100))
            cols[0].append(r)
            cols[1].append(slot * 100)
            cols[2].append(draw(st.integers(0, size - n)))
            cols[3].append(n)
    a = [np.array(c, dtype=np.int64) for c in cols]
    return RangeCopy(a[0], a[1], a[2], a[3])


@settings(max_examples=100, deadline=None)
@given(copies())
def test_prepared_regions_copy_the_same_bytes_as_tensor_lists(rc: RangeCopy) -> None:
    src = _regions(1)
    plain = _regions(2)
    prepared = _regions(2)
    twin.copy_ranges(plain, src, rc)
    d, s = Regions.of("dst", prepared), Regions.of("src", src)
    assert copy_ranges(d, s, rc) == "torch"
    assert all(torch.equal(a, b) for a, b in zip(plain, prepared, strict=True))
    table = address_table(d, s, rc).numpy()
    assert np.array_equal(table, address_table(prepared, src, rc).numpy())
    for (dst_addr, src_addr, n), r, a, b, ln in zip(
        table, rc.region, rc.dst_offset, rc.src_offset, rc.length, strict=True
    ):
        assert dst_addr == prepared[r].data_ptr() + a and src_addr == src[r].data_ptr() + b
        assert n == ln


def test_regions_are_checked_once_and_reused_as_they_are() -> None:
    d = Regions.of("dst", _regions(1))
    assert Regions.of("dst", d) is d
    assert d.size.tolist() == SIZES and len(d) == 3
    assert d.base.tolist() == [t.data_ptr() for t in d.tensors]


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (torch.zeros(8, dtype=torch.int32), r"dst\[1\] must be a 1-D contiguous uint8"),
        (torch.zeros(4, 4, dtype=torch.uint8), r"dst\[1\] must be a 1-D contiguous uint8"),
        (torch.zeros(16, dtype=torch.uint8)[::2], r"dst\[1\] must be a 1-D contiguous uint8"),
    ],
)
def test_malformed_regions_are_refused(bad: torch.Tensor, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        Regions.of("dst", [torch.zeros(8, dtype=torch.uint8), bad])


def test_mismatched_sides_and_pieces_outside_a_region_are_refused_before_any_copy() -> None:
    src, dst = _regions(1), _regions(2)
    before = [t.clone() for t in dst]
    one = np.array([1], dtype=np.int64)
    with pytest.raises(InvalidRequest, match="3 destination and 2 source regions"):
        check_ranges(dst, src[:2], RangeCopy.empty())
    past = RangeCopy(one, np.array([990], dtype=np.int64), one, np.array([20], dtype=np.int64))
    with pytest.raises(BlockRangeError, match=r"bytes \[990, 1010\) of dst region 1, which has"):
        copy_ranges(Regions.of("dst", dst), Regions.of("src", src), past)
    region = np.array([3], dtype=np.int64)
    with pytest.raises(BlockRangeError, match="names region 3 of 3"):
        copy_ranges(dst, src, RangeCopy(region, one, one, one))
    assert all(torch.equal(a, b) for a, b in zip(dst, before, strict=True))


@st.composite
def groups(draw: st.DrawFn) -> list[GroupCopy]:
    """Groups of runs over subsets of the regions; offsets may reach past a small region (the
    checks must refuse exactly those), lengths may be zero (refused too)."""
    out = []
    for _ in range(draw(st.integers(0, 3))):
        regions = draw(st.lists(st.integers(0, len(SIZES) - 1), min_size=0, max_size=3))
        # Few runs (the checks' list path) or more than SMALL (their NumPy path).
        n = draw(st.one_of(st.integers(0, 4), st.integers(SMALL + 1, SMALL + 20)))
        cols = [
            [draw(st.integers(0, 4200)) for _ in range(n)],
            [draw(st.integers(0, 4200)) for _ in range(n)],
            [draw(st.integers(0, 120)) for _ in range(n)],
        ]
        out.append(
            GroupCopy(np.array(regions, dtype=np.int64), *(np.array(c, np.int64) for c in cols))
        )
    return out


def _flat(gs: list[GroupCopy]) -> RangeCopy:
    return RangeCopy.concat([g.flat() for g in gs if g.pieces])


@settings(max_examples=300, deadline=None)
@given(groups())
def test_group_checks_refuse_exactly_what_the_flat_checks_refuse(gs: list[GroupCopy]) -> None:
    dst, src = _regions(1), _regions(2)
    try:
        check_ranges(dst, src, _flat(gs))
        flat_ok = True
    except BlockRangeError:
        flat_ok = False
    try:
        check_groups(dst, src, gs)
        group_ok = True
    except BlockRangeError:
        group_ok = False
    assert group_ok == flat_ok


@settings(max_examples=100, deadline=None)
@given(copies(), st.lists(st.integers(0, len(SIZES) - 1), min_size=1, max_size=3, unique=True))
def test_a_group_copies_what_its_flat_pieces_copy(rc: RangeCopy, regions: list[int]) -> None:
    # The runs of region 1 (the smallest) fit every region: repeat them over ``regions``.
    keep = rc.region == 1
    g = GroupCopy(
        np.array(regions, dtype=np.int64), rc.dst_offset[keep], rc.src_offset[keep], rc.length[keep]
    )
    src = _regions(3)
    want, got = _regions(4), _regions(4)
    twin.copy_ranges(want, src, g.flat() if g.pieces else RangeCopy.empty())
    assert copy_groups(got, src, [g]) == "torch"  # CPU tensors: the twin
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    if g.pieces:
        table = group_table(Regions.of("dst", got), Regions.of("src", src), g)
        n, k = int(g.length.size), len(regions)
        assert table.numel() == 3 * n + 2 * k  # the runs once, then each region's two bases
        assert table[3 * n :].view(k, 2)[:, 0].tolist() == [got[r].data_ptr() for r in regions]


def test_group_checks_stay_exact_when_the_regions_array_is_reused() -> None:
    """check_groups works out a read-only regions array's smallest region once per side
    (Regions.among: the planner shares one array between pulls); every pull's offsets are
    still checked, and a writable array is looked at afresh each time."""
    dst, src = Regions.of("dst", _regions(1)), Regions.of("src", _regions(2))
    shared = np.array([0, 2], dtype=np.int64)
    shared.setflags(write=False)

    def group(regions: np.ndarray, end: int) -> GroupCopy:
        one = np.array([end - 8], dtype=np.int64)
        return GroupCopy(regions, one, one.copy(), np.array([8], dtype=np.int64))

    check_groups(dst, src, [group(shared, SIZES[2])])  # region 2 is the smaller of 0 and 2
    with pytest.raises(BlockRangeError, match="region 2 has 2048 bytes"):
        check_groups(dst, src, [group(shared, SIZES[2] + 8)])
    assert dst.among(shared) == (0, 2, 2) and id(shared) in dst.facts
    mutable = np.array([0, 2], dtype=np.int64)
    check_groups(dst, src, [group(mutable, SIZES[2])])
    mutable[1] = 1  # now region 1 (1,000 bytes) is the smallest
    with pytest.raises(BlockRangeError, match="region 1 has 1000 bytes"):
        check_groups(dst, src, [group(mutable, SIZES[2])])
    assert id(mutable) not in dst.facts
    for _ in range(100):  # bounded however many arrays come by
        a = np.array([0], dtype=np.int64)
        a.setflags(write=False)
        dst.among(a)
    assert len(dst.facts) <= 64


def test_group_tables_gather_each_pair_of_sides_bases_once_and_follow_a_new_source() -> None:
    """group_table keeps a read-only regions array's base pairs per source side: a table built
    from them equals one built afresh, another source side (a peer's new mappings) gets its own
    bases, and a writable array is gathered afresh each time."""
    dst = Regions.of("dst", _regions(1))
    src_a, src_b = Regions.of("src", _regions(2)), Regions.of("src", _regions(3))
    shared = np.array([2, 0], dtype=np.int64)
    shared.setflags(write=False)
    run = np.array([0, 64], dtype=np.int64)
    g = GroupCopy(shared, run, run + 8, np.array([8, 16], dtype=np.int64))

    def want(s: Regions, regions: list[int]) -> list[int]:
        runs = [0, 8, 8, 64, 72, 16]
        return runs + [x for r in regions for x in (int(dst.base[r]), int(s.base[r]))]

    assert group_table(dst, src_a, g).tolist() == want(src_a, [2, 0])
    assert group_table(dst, src_a, g).tolist() == want(src_a, [2, 0])  # kept
    assert len(src_a.pair_bases) == 1 and not dst.pair_bases  # with the source side's mappings
    assert group_table(dst, src_b, g).tolist() == want(src_b, [2, 0])  # another source
    mutable = np.array([2, 0], dtype=np.int64)
    m = GroupCopy(mutable, run, run + 8, np.array([8, 16], dtype=np.int64))
    assert group_table(dst, src_a, m).tolist() == want(src_a, [2, 0])
    mutable[0] = 1
    assert group_table(dst, src_a, m).tolist() == want(src_a, [1, 0])
    assert len(src_a.pair_bases) == 1  # the writable array was never kept


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(-(2**40), 2**40), st.integers(-(2**30), 2**30)),
        min_size=1,
        max_size=2 * SMALL,
    )
)
def test_bounds_and_extent_agree_with_numpy_on_both_sides_of_small(
    rows: list[tuple[int, int]],
) -> None:
    off = np.array([r[0] for r in rows], dtype=np.int64)
    length = np.array([r[1] for r in rows], dtype=np.int64)
    assert lo_hi(off) == (int(off.min()), int(off.max()))
    assert extent(off, length) == (int(off.min()), int((off + length).max()))
    assert all(type(v) is int for v in (*lo_hi(off), *extent(off, length)))


@pytest.mark.parametrize(
    "bad",
    [
        lambda t: t.to(torch.int32),
        lambda t: t.reshape(-1, 1),
        lambda t: torch.stack((t, t), dim=1)[:, 0],  # strided, not contiguous
    ],
    ids=["int32", "2-D", "strided"],
)
def test_a_copy_for_the_kernel_refuses_a_group_table_it_could_not_hand_over(bad: object) -> None:
    """The group launch hands a table's address to the extension (cuda/bindings.cpp): a copy
    made for the kernel holds only contiguous 1-D int64 CPU tables."""
    d, s = Regions.of("dst", _regions(1)), Regions.of("src", _regions(2))
    g = GroupCopy(np.array([0, 2]), np.array([0]), np.array([8]), np.array([16]))
    table = group_table(d, s, g)
    CheckedCopy(d, s, None, (g,), (table,), True)  # as check_copy makes it
    with pytest.raises(InvalidRequest, match="contiguous 1-D int64 CPU tensor"):
        CheckedCopy(d, s, None, (g,), (bad(table),), True)  # type: ignore[operator]


WRAPS = (1 << 63) - 100  # a start whose end, offset + length, wraps past int64


@pytest.mark.parametrize("runs", [1, SMALL + 1])  # Python ints, then NumPy's int64
def test_a_range_whose_end_wraps_past_int64_is_refused_by_every_check(runs: int) -> None:
    """The bounds checks compare offset > size - length: a start near 2^63 whose end wraps
    negative in int64 would pass offset + length > size."""
    d, s = _regions(1), _regions(2)
    with pytest.raises(BlockRangeError):
        check_ranges(d, s, RangeCopy(_a([0]), _a([0]), _a([WRAPS]), _a([64])))
    src = _a([0] * (runs - 1) + [WRAPS])
    group = GroupCopy(_a([0]), _a(np.arange(runs) * 8), src, _a([8] * runs))
    with pytest.raises(BlockRangeError):
        check_groups(d, s, [group])
    assert extent(src, _a([8] * runs))[1] == WRAPS + 8  # exact, as Python ints
    local = RegionTable.from_array([[0x10000, 1 << 16, 0]])
    remote = RegionTable.from_array([[0x7000000, 1 << 16, 0]])
    plan = TransferPlan((RegionRanges(0, "r", _a([0]), _a([WRAPS]), _a([4096])),))
    with pytest.raises(BlockRangeError):
        build_descriptors(plan, local, remote)


def _a(values: object) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def test_a_memo_drop_that_loses_a_race_to_another_thread_is_skipped() -> None:
    # The loop (inline pulls) and a worker thread (big pulls) share a Regions' memos. A fault
    # we cannot cause on demand, so the other thread is played by the memo itself: it drops the
    # oldest entry between our pick of it and our pop.
    from kvxferd.kernels import ranges

    class Raced(dict[int, int]):
        def pop(self, key: int, *default: int) -> int:
            super().pop(key)  # the other thread got there first
            return super().pop(key, *default)

    memo = Raced((i, i) for i in range(ranges._MAX_FACTS))
    ranges._remember(memo, -1, -1)
    assert memo[-1] == -1 and len(memo) == ranges._MAX_FACTS
