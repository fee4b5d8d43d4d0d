"""Range copies on CPU: regions checked once (:class:`Regions`) give the same checks, table and
bytes as plain tensor lists, and bad regions or pieces are refused before anything is copied."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.errors import BlockRangeError, InvalidRequest
from kvxferd.kernels import RangeCopy, Regions, copy_ranges, twin
from kvxferd.kernels.ranges import address_table, check_ranges

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
