"""Descriptor building and coalescing: pure, no NIXL."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.blocks import plan_pull
from kvxferd.blocks.ranges import RegionRanges, TransferPlan
from kvxferd.errors import BlockRangeError, InvalidRequest
from kvxferd.layout.presets import preset
from kvxferd.transfer.descriptors import RegionTable, build_descriptors, coalesce, split_runs

LOCAL = RegionTable.from_array([[0x10000, 1 << 20, 0], [0x400000, 1 << 20, 1]])
REMOTE = RegionTable.from_array([[0x7000000, 1 << 20, 3], [0x9000000, 1 << 20, 4]])


def _plan(region: int, lo: list[int], ro: list[int], ln: list[int]) -> TransferPlan:
    a = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    return TransferPlan((RegionRanges(region, "r", a(lo), a(ro), a(ln)),))


def test_bases_and_devices_are_added_per_region() -> None:
    loc, rem = build_descriptors(_plan(1, [0, 4096], [8192, 0], [1024, 1024]), LOCAL, REMOTE)
    assert loc.tolist() == [[0x400000, 1024, 1], [0x400000 + 4096, 1024, 1]]
    assert rem.tolist() == [[0x9000000 + 8192, 1024, 4], [0x9000000, 1024, 4]]
    assert loc.dtype == np.int64 and rem.dtype == np.int64


def test_contiguous_blocks_become_one_descriptor_per_region() -> None:
    blocks = np.arange(10, 60, dtype=np.int64)
    rng = np.random.default_rng(0)
    perm = rng.permutation(blocks.size)  # order in the plan must not matter
    ranges = tuple(
        RegionRanges(
            r,
            f"l{r}",
            blocks[perm] * 4096,
            (blocks[perm] + 5) * 4096,
            np.full(blocks.size, 4096, dtype=np.int64),
        )
        for r in range(2)
    )
    loc, rem = build_descriptors(TransferPlan(ranges), LOCAL, REMOTE)
    assert loc.shape == (2, 3)
    assert loc[:, 1].tolist() == [50 * 4096, 50 * 4096]
    assert rem[0, 0] == REMOTE.base[0] + 15 * 4096


def test_contiguous_on_one_side_only_is_not_merged() -> None:
    loc, _ = build_descriptors(_plan(0, [0, 1024], [0, 4096], [1024, 1024]), LOCAL, REMOTE)
    assert loc.shape[0] == 2


def test_merge_can_be_disabled() -> None:
    loc, _ = build_descriptors(
        _plan(0, [0, 1024], [0, 1024], [1024, 1024]), LOCAL, REMOTE, merge=False
    )
    assert loc.shape[0] == 2


def test_empty_plan_gives_no_descriptors() -> None:
    loc, rem = build_descriptors(TransferPlan(()), LOCAL, REMOTE)
    assert loc.shape == (0, 3) and rem.shape == (0, 3)


@pytest.mark.parametrize(("lo", "ro"), [([1 << 20], [0]), ([0], [(1 << 20) - 10]), ([-4], [0])])
def test_out_of_region_ranges_are_rejected(lo: list[int], ro: list[int]) -> None:
    with pytest.raises(BlockRangeError):
        build_descriptors(_plan(0, lo, ro, [16]), LOCAL, REMOTE)


def test_unknown_region_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="region 5"):
        build_descriptors(_plan(5, [0], [0], [16]), LOCAL, REMOTE)


def test_bad_region_table_is_rejected() -> None:
    with pytest.raises(InvalidRequest):
        RegionTable.from_array([[1, 2]])
    with pytest.raises(InvalidRequest):
        RegionTable.from_array([[0, 16, 0]])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 200), st.integers(0, 200)),
        min_size=0,
        max_size=60,
        unique_by=lambda t: t[0],
    ),
    st.integers(1, 3),
)
def test_coalesce_keeps_every_byte_pairing_exactly_once(
    pairs: list[tuple[int, int]], blk: int
) -> None:
    lo = np.array([p[0] * blk for p in pairs], dtype=np.int64)
    ro = np.array([p[1] * blk for p in pairs], dtype=np.int64)
    ln = np.full(len(pairs), blk, dtype=np.int64)
    mlo, mro, mln = coalesce(lo, ro, ln)
    # Expanding merged ranges byte by byte gives exactly the original (local, remote) pairs.
    want = sorted(
        (int(a) + k, int(b) + k) for a, b, n in zip(lo, ro, ln, strict=True) for k in range(int(n))
    )
    got = sorted(
        (int(a) + k, int(b) + k)
        for a, b, n in zip(mlo, mro, mln, strict=True)
        for k in range(int(n))
    )
    assert got == want
    assert mln.size <= ln.size
    # Maximal: no two merged ranges could be merged further.
    if mln.size > 1:
        assert not np.any((mlo[:-1] + mln[:-1] == mlo[1:]) & (mro[:-1] + mln[:-1] == mro[1:]))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=0, max_size=20), st.integers(1, 16))
def test_split_runs_covers_each_range_exactly(lengths: list[int], max_len: int) -> None:
    ln = np.array(lengths, dtype=np.int64)
    lo = np.cumsum(np.concatenate(([0], ln[:-1] + 7))).astype(np.int64) if lengths else ln
    ro = lo + 1000
    region = np.arange(ln.size, dtype=np.int64)  # each piece must keep its range's
    sreg, slo, sro, sln = split_runs(region, lo, ro, ln, max_len)
    assert ((lo[sreg] <= slo) & (slo + sln <= lo[sreg] + ln[sreg])).all()
    assert (sln <= max_len).all() and (sln > 0).all()
    assert (sro - slo == 1000).all()
    want = sorted(int(a) + k for a, n in zip(lo, ln, strict=True) for k in range(int(n)))
    got = sorted(int(a) + k for a, n in zip(slo, sln, strict=True) for k in range(int(n)))
    assert got == want


def test_build_descriptors_splits_after_merging() -> None:
    blocks = np.arange(0, 16, dtype=np.int64)
    plan = TransferPlan(
        (RegionRanges(0, "l0", blocks * 4096, blocks * 4096, np.full(16, 4096, dtype=np.int64)),)
    )
    loc, rem = build_descriptors(plan, LOCAL, REMOTE, max_desc_bytes=5 * 4096)
    assert (rem[:, 0] - REMOTE.base[0]).tolist() == [0, 5 * 4096, 10 * 4096, 15 * 4096]
    assert loc[:, 1].tolist() == [5 * 4096, 5 * 4096, 5 * 4096, 4096]
    assert (loc[:, 0] - LOCAL.base[0]).tolist() == [0, 5 * 4096, 10 * 4096, 15 * 4096]


_SPECS = {
    name: preset(f"{name}:num_blocks=12")
    for name in ("dense", "hybrid", "mla")  # one group; two groups; many regions of one size
}


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(sorted(_SPECS)),
    st.data(),
    st.lists(st.integers(-3, 0), min_size=0, max_size=4),
)
def test_grouped_descriptors_are_the_flat_ones(
    name: str, data: st.DataObject, cut: list[int]
) -> None:
    """Runs shared by regions are checked and laid out once per group (the planner's common
    case); the result, or the refusal, is the flat path's (every row built and checked; the
    flat path runs when ranges are cut, here by a limit no range reaches). ``cut`` shrinks
    some regions of one side by up to three blocks, so that some plans leave them; half the
    time that side also lacks its last region."""
    spec = _SPECS[name]
    ids = st.lists(st.integers(0, 11), min_size=0, max_size=8, unique=True)
    local = [data.draw(ids) for _ in spec.groups]
    remote = [data.draw(st.permutations(ids_)) for ids_ in local]
    part = plan_pull(spec, spec, remote, local, prefix_caching=False).per_rank[0]
    rows = np.array(
        [[(i + 1) << 32, r.nbytes, i % 3] for i, r in enumerate(spec.regions)], dtype=np.int64
    )
    side = data.draw(st.sampled_from(["local", "remote"]))
    short = rows.copy()
    for k, c in enumerate(cut):
        r = spec.regions[(k * 7) % len(spec.regions)]
        short[(k * 7) % len(spec.regions), 1] = r.nbytes + c * r.block_len
    if data.draw(st.booleans()):  # that side registered one region fewer than the plan names
        short = short[:-1]
    lt = RegionTable.from_array(short if side == "local" else rows)
    rt = RegionTable.from_array(short if side == "remote" else rows)

    def outcome(**kw: int) -> tuple[str, object]:
        try:
            loc, rem = build_descriptors(part, lt, rt, **kw)
        except (BlockRangeError, InvalidRequest) as exc:
            return type(exc).__name__, str(exc)
        return "ok", (loc.tolist(), rem.tolist())

    assert outcome() == outcome(max_desc_bytes=1 << 62)
