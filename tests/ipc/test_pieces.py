"""Properties of a KERNEL pull's pieces (pure, CPU): whatever the plan, the pieces move exactly
the plan's bytes (each destination byte from the same source byte, nothing more), every piece
fits the power-of-two slot the copy kernel gives it, and the slot size is the cheapest one by
the reader's own cost."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.blocks.ranges import RegionRanges, TransferPlan
from kvxferd.ipc.pieces import MIN_PIECE_BYTES, PIECE_COST_BYTES, piece_size, pieces
from kvxferd.kernels import RangeCopy

Interval = tuple[int, int, int, int]  # region, dst start, src start, length


def _canonical(rows: list[Interval]) -> list[Interval]:
    """Sorted by (region, dst), adjacent intervals merged when contiguous on both sides: two
    lists of intervals move the same bytes exactly when their canonical forms are equal."""
    out: list[Interval] = []
    for r, d, s, n in sorted(rows):
        if (
            out
            and out[-1][0] == r
            and out[-1][1] + out[-1][3] == d
            and out[-1][2] + out[-1][3] == s
        ):
            out[-1] = (r, out[-1][1], out[-1][2], out[-1][3] + n)
        else:
            out.append((r, d, s, n))
    return out


@st.composite
def plans(draw: st.DrawFn) -> TransferPlan:
    """Up to 8 regions, each reading up to 24 blocks of one size (64 B to 8 KiB) into distinct
    local blocks, in any order, with local and remote runs that sometimes line up; sometimes
    every region shares the first one's arrays, as the planner does for layers of one
    geometry."""
    ranges: list[RegionRanges] = []
    share = draw(st.booleans())
    for region in draw(st.lists(st.integers(0, 9), max_size=8, unique=True)):
        if share and ranges:
            first = ranges[0]
            ranges.append(
                RegionRanges(
                    region, f"r{region}", first.local_offset, first.remote_offset, first.length
                )
            )
            continue
        size = draw(st.sampled_from([64, 512, 1536, 4096, 8192]))
        local = draw(st.lists(st.integers(0, 63), max_size=24, unique=True))
        shift = draw(st.integers(0, 8))
        aligned = draw(st.booleans())
        remote = (
            [b + shift for b in local]
            if aligned
            else draw(st.lists(st.integers(0, 63), min_size=len(local), max_size=len(local)))
        )
        ranges.append(
            RegionRanges(
                region,
                f"r{region}",
                np.array(local, dtype=np.int64) * size,
                np.array(remote, dtype=np.int64) * size,
                np.full(len(local), size, dtype=np.int64),
            )
        )
    return TransferPlan(tuple(ranges))


def _unshared(plan: TransferPlan) -> TransferPlan:
    """The same plan with every region's arrays copied (no sharing: the one-sort path)."""
    return TransferPlan(
        tuple(
            RegionRanges(
                rr.region,
                rr.name,
                rr.local_offset.copy(),
                rr.remote_offset.copy(),
                rr.length.copy(),
            )
            for rr in plan.ranges
        )
    )


def _rows(rc: RangeCopy) -> list[Interval]:
    return sorted(
        zip(
            rc.region.tolist(),
            rc.dst_offset.tolist(),
            rc.src_offset.tolist(),
            rc.length.tolist(),
            strict=True,
        )
    )


@settings(max_examples=200, deadline=None)
@given(plans(), st.sampled_from([512, 1000, 4096, 1 << 20]))
def test_pieces_move_exactly_the_plans_bytes(plan: TransferPlan, largest: int) -> None:
    rc, runs = pieces(plan, piece_bytes=largest)
    want = _canonical(
        [
            (rr.region, int(a), int(b), int(n))
            for rr in plan.ranges
            for a, b, n in zip(rr.local_offset, rr.remote_offset, rr.length, strict=True)
        ]
    )
    got = _rows(rc)
    assert _canonical(got) == want
    alone, alone_runs = pieces(_unshared(plan), piece_bytes=largest)
    assert _rows(alone) == got and alone_runs == runs  # shared arrays: the same pieces
    assert rc.nbytes == plan.nbytes
    assert runs == len(want) <= plan.num_ranges  # DIRECT's descriptors after coalescing
    if rc.pieces:
        slot = piece_size(np.array([n for *_, n in want], dtype=np.int64), largest)
        assert int(rc.length.max()) <= slot <= max(largest, MIN_PIECE_BYTES)
        assert rc.pieces == sum(-(-n // slot) for *_, n in want)  # each run cut at the slot


def _cost(lengths: np.ndarray, slot: int) -> int:
    return int(sum(-(-int(n) // slot) for n in lengths)) * (slot + PIECE_COST_BYTES)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 3 << 20), min_size=1, max_size=40),
    st.sampled_from([512, 3000, 64 << 10, 1 << 20]),
)
def test_piece_size_is_the_cheapest_power_of_two_from_the_shortest_run_up(
    lengths: list[int], largest: int
) -> None:
    ln = np.array(lengths, dtype=np.int64)
    got = piece_size(ln, largest)
    top = 1 << (max(largest, MIN_PIECE_BYTES).bit_length() - 1)
    assert got & (got - 1) == 0 and MIN_PIECE_BYTES <= got <= top
    floor = min(top, max(MIN_PIECE_BYTES, 1 << (min(lengths) - 1).bit_length()))
    tried = [1 << k for k in range(floor.bit_length() - 1, top.bit_length())]
    assert got in tried
    assert all(_cost(ln, got) <= _cost(ln, p) for p in tried)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 3 << 20), st.integers(1, 40)), min_size=1, max_size=20),
    st.sampled_from([512, 64 << 10, 1 << 20]),
)
def test_weighted_piece_size_is_the_piece_size_of_the_repeated_runs(
    runs: list[tuple[int, int]], largest: int
) -> None:
    # A run shared by k regions counts k times: sizing it once with weight k must pick what
    # sizing the k copies would (the reader sizes a shared array once, not per layer).
    ln = np.array([n for n, _ in runs], dtype=np.int64)
    w = np.array([k for _, k in runs], dtype=np.int64)
    assert piece_size(ln, largest, w) == piece_size(np.repeat(ln, w), largest)


def test_random_and_contiguous_llama_pulls_get_block_and_megabyte_pieces() -> None:
    """The bench's 1 GiB cases planned by the daemon's planner (32 layers x 512 blocks of
    64 KiB, every layer sharing one set of arrays): random blocks are one 64 KiB piece each;
    contiguous ones one 32 MiB run per layer, cut into 1 MiB pieces."""
    from kvxferd.blocks import plan_pull
    from kvxferd.layout.presets import preset

    spec = preset("dense", num_blocks=4096)
    rng = np.random.default_rng(0)
    block = 64 << 10
    for local, remote, want_size, want_pieces in (
        (rng.choice(4096, 512, replace=False), rng.choice(4096, 512, replace=False), block, None),
        (np.arange(100, 612), np.arange(7, 519), 1 << 20, 32 * 32),
    ):
        part = plan_pull(spec, spec, [local], [remote], prefix_caching=False).per_rank[0]
        assert len({id(rr.local_offset) for rr in part.ranges}) == 1  # shared by all layers
        rc, runs = pieces(part)
        assert int(rc.length.max()) == want_size and rc.nbytes == part.nbytes == 32 * 512 * block
        assert rc.pieces == (want_pieces or runs) and runs <= part.num_ranges
        assert _rows(rc) == _rows(pieces(_unshared(part))[0])
