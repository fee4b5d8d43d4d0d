"""Coalescing: every planned byte exactly once on each side, nothing past a region's end,
runs merged only where memory is contiguous on both sides."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from blocks_helpers import PROPS
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.blocks import coalesce, find_runs
from kvxferd.blocks.tp import RankSegments
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import Layout, Region


def _region(num_blocks: int, block_len: int, stride: int) -> Region:
    """A STATE region of ``block_len`` bytes per block (fp8 elements) and the given stride."""
    return Region(
        "r", 0, KVDType.FP8_E4M3, Layout.STATE, (num_blocks, block_len), block_stride=stride
    )


def test_find_runs() -> None:
    runs = find_runs([5, 6, 7, 1, 2, 9], [10, 11, 3, 4, 5, 12])
    assert runs.local_ids.tolist() == [1, 2, 5, 6, 7, 9]
    assert runs.remote_ids.tolist() == [4, 5, 10, 11, 3, 12]
    assert runs.local_start.tolist() == [1, 5, 7, 9]
    assert runs.remote_start.tolist() == [4, 10, 3, 12]
    assert runs.length.tolist() == [2, 2, 1, 1]
    assert find_runs([], []).num_runs == 0


def test_contiguous_request_is_one_range() -> None:
    r = _region(100, 64, 0)
    rg = coalesce(np.arange(10, 60), np.arange(0, 50), r, r, RankSegments.whole(0, 64))
    assert rg.num_ranges == 1
    assert (rg.local_offset[0], rg.remote_offset[0], rg.length[0]) == (640, 0, 50 * 64)


def test_padded_stride_does_not_merge() -> None:
    r = _region(100, 64, 80)
    rg = coalesce(np.arange(3), np.arange(3), r, r, RankSegments.whole(0, 64))
    assert rg.length.tolist() == [64, 64, 64] and rg.local_offset.tolist() == [0, 80, 160]


@st.composite
def _segments(draw: st.DrawFn) -> tuple[RankSegments, int, int]:
    """Non-overlapping segments inside a local and a remote block; returns their lengths."""
    if draw(st.booleans()):
        n = draw(st.integers(1, 24))
        return RankSegments.whole(0, n), n, n
    lens = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    offs = []
    for order in (list(range(len(lens))), draw(st.permutations(range(len(lens))))):
        # lay the segments out in `order` (remote may differ from local), with random gaps
        gaps = draw(st.lists(st.integers(0, 4), min_size=len(lens) + 1, max_size=len(lens) + 1))
        pos, out = gaps[0], [0] * len(lens)
        for i, gp in zip(order, gaps[1:], strict=True):
            out[i] = pos
            pos += lens[i] + gp
        offs.append((out, pos))
    (lo, l_len), (ro, r_len) = offs

    def arr(x: list[int]) -> npt.NDArray[np.int64]:
        return np.array(x, dtype=np.int64)

    return RankSegments(0, arr(lo), arr(ro), arr(lens), False), max(l_len, 1), max(r_len, 1)


@st.composite
def _pairs(draw: st.DrawFn, n_local: int, n_remote: int) -> tuple[list[int], list[int]]:
    k = draw(st.integers(0, min(n_local, n_remote)))
    if draw(st.booleans()):  # runs: consecutive on both sides, in a random order
        ls = draw(st.integers(0, n_local - k))
        rs = draw(st.integers(0, n_remote - k))
        perm = draw(st.permutations(range(k)))
        return [ls + i for i in perm], [rs + i for i in perm]
    loc = draw(st.permutations(range(n_local)))[:k]
    rem = draw(st.permutations(range(n_remote)))[:k]
    return list(loc), list(rem)


def _bytes(r: Region) -> npt.NDArray[np.int64]:
    return np.zeros(r.nbytes, dtype=np.int64)


@PROPS
@given(_segments(), st.integers(1, 30), st.integers(1, 30), st.integers(0, 8), st.data())
def test_every_byte_exactly_once(
    segs: tuple[RankSegments, int, int],
    n_local: int,
    n_remote: int,
    pad: int,
    data: st.DataObject,
) -> None:
    seg, l_len, r_len = segs
    l_pad, r_pad = data.draw(st.integers(0, pad)), data.draw(st.integers(0, pad))
    local = _region(n_local, l_len, l_len + l_pad)
    remote = _region(n_remote, r_len, r_len + r_pad)
    lids, rids = data.draw(_pairs(n_local, n_remote))
    rg = coalesce(np.array(lids, np.int64), np.array(rids, np.int64), local, remote, seg)

    # expected byte map local -> remote, block by block
    want = np.full(local.nbytes, -1, dtype=np.int64)
    for lb, rb in zip(lids, rids, strict=True):
        for lo, ro, n in zip(seg.local_offset, seg.remote_offset, seg.length, strict=True):
            a, b = lb * local.stride + lo, rb * remote.stride + ro
            want[a : a + n] = np.arange(b, b + n)

    got = np.full(local.nbytes, -1, dtype=np.int64)
    lcount, rcount = _bytes(local), _bytes(remote)
    assert (rg.length > 0).all()
    for lo, ro, n in zip(rg.local_offset, rg.remote_offset, rg.length, strict=True):
        assert lo >= 0 and lo + n <= local.nbytes  # never past the region's end
        assert ro >= 0 and ro + n <= remote.nbytes
        lcount[lo : lo + n] += 1
        rcount[ro : ro + n] += 1
        got[lo : lo + n] = np.arange(ro, ro + n)
    assert lcount.max(initial=0) <= 1 and rcount.max(initial=0) <= 1
    assert (got == want).all()
    assert rg.nbytes == len(lids) * int(seg.length.sum())

    # maximal merging when blocks are contiguous on both sides
    if seg.whole_block and l_pad == 0 and r_pad == 0 and l_len == r_len:
        assert rg.num_ranges == find_runs(lids, rids).num_runs
        ends_l = rg.local_offset[:-1] + rg.length[:-1]
        ends_r = rg.remote_offset[:-1] + rg.length[:-1]
        assert not ((ends_l == rg.local_offset[1:]) & (ends_r == rg.remote_offset[1:])).any()
    else:
        assert rg.num_ranges == len(lids) * seg.num_segments


def test_find_runs_sparse_and_duplicate_ids_sort_stably() -> None:
    """IDs too sparse for the counting sort, or repeated, fall back to a stable argsort."""
    far = [1 << 40, 3, (1 << 40) + 1, 2]
    runs = find_runs(far, [11, 1, 12, 0])
    assert runs.local_ids.tolist() == [2, 3, 1 << 40, (1 << 40) + 1]
    assert runs.length.tolist() == [2, 2]
    dup = find_runs([4, 1, 4], [9, 8, 7])
    assert dup.local_ids.tolist() == [1, 4, 4] and dup.remote_ids.tolist() == [8, 9, 7]
