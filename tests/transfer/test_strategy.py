"""The cost model, the choice between DIRECT and STAGED, eligibility, and chunking (pure)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.errors import InvalidRequest
from kvxferd.layout.presets import preset
from kvxferd.layout.spec import MemoryType
from kvxferd.staging.chunks import RingInfo, span_offsets, split_chunks
from kvxferd.staging.strategy import (
    STAGED_MARGIN,
    CostModel,
    Mode,
    Strategy,
    choose,
    group_row_bytes,
    staged_ineligible,
)

GPU = CostModel.defaults(MemoryType.VRAM)
CPU = CostModel.defaults(MemoryType.DRAM)
RING = RingInfo(base=1 << 20, chunk_bytes=64 << 20, chunks=8, device=0)
GIB = 1 << 30


def test_reference_1gib_fragmented_case_prefers_staged_on_gpu() -> None:
    # 1 GiB of random blocks per layer: 16,384 descriptors of 64 KiB; 16 chunks of 64 MiB.
    c = choose(Mode.AUTO, GPU, descriptors=16384, nbytes=GIB, chunks=16, ineligible=None)
    assert c.strategy is Strategy.STAGED
    assert c.direct_s == pytest.approx(16384 * 6e-6 + GIB / 394e9)
    assert c.staged_s == pytest.approx(GIB / 394e9 + 16 * 5e-3 + (GIB / 16) / 873e9 * 2, rel=0.2)


def test_small_fragmented_request_stays_direct_on_gpu() -> None:
    # 16 blocks x 32 layers (512 descriptors of 64 KiB, 32 MiB), one chunk: measured on two
    # H200s, DIRECT 4.1 GB/s against STAGED 2.6 GB/s (docs/benchmarks.md).
    c = choose(Mode.AUTO, GPU, descriptors=512, nbytes=32 << 20, chunks=1, ineligible=None)
    assert c.strategy is Strategy.DIRECT


def test_contiguous_request_stays_direct() -> None:
    c = choose(Mode.AUTO, GPU, descriptors=32, nbytes=GIB, chunks=16, ineligible=None)
    assert c.strategy is Strategy.DIRECT
    assert "direct" in c.reason


def test_forced_modes_and_fallback() -> None:
    kw = {"descriptors": 4, "nbytes": 1 << 20, "chunks": 1}
    assert choose(Mode.STAGED, CPU, ineligible=None, **kw).strategy is Strategy.STAGED  # type: ignore[arg-type]
    assert (
        choose(Mode.DIRECT, CPU, descriptors=10**6, nbytes=GIB, chunks=1, ineligible=None).strategy
        is Strategy.DIRECT
    )
    c = choose(Mode.STAGED, CPU, ineligible="peer has no ring", **kw)  # type: ignore[arg-type]
    assert c.strategy is Strategy.DIRECT
    assert "fell back to DIRECT" in c.reason and "peer has no ring" in c.reason
    assert math.isnan(c.staged_s)


def test_overrides_replace_only_nonzero_figures() -> None:
    m = GPU.with_overrides(descriptor_us=2.0, link_gbps=50.0)
    assert m.descriptor_s == 2e-6 and m.link_bps == 50e9
    assert m.chunk_s == GPU.chunk_s and m.gather_bps == GPU.gather_bps


@given(
    desc=st.integers(0, 1 << 20),
    nbytes=st.integers(0, 1 << 36),
    chunks=st.integers(1, 4096),
)
def test_estimates_are_monotonic_and_choice_is_the_cheaper(
    desc: int, nbytes: int, chunks: int
) -> None:
    for m in (GPU, CPU):
        d = m.direct_seconds(desc, nbytes)
        assert d <= m.direct_seconds(desc + 1, nbytes)
        assert d <= m.direct_seconds(desc, nbytes + 1)
        s = m.staged_seconds(nbytes, chunks)
        assert s >= 0
        c = choose(Mode.AUTO, m, descriptors=desc, nbytes=nbytes, chunks=chunks, ineligible=None)
        if c.strategy is Strategy.STAGED:
            assert c.staged_s < c.direct_s * STAGED_MARGIN
        else:
            assert nbytes == 0 or c.direct_s * STAGED_MARGIN <= c.staged_s


def test_eligibility_reasons() -> None:
    dense = preset("dense:num_blocks=8")
    kw = {"local_tp_size": 1, "remote_tp_size": 1, "peer": "p:1"}
    assert staged_ineligible(dense, dense, local_ring=RING, remote_ring=RING, **kw) is None  # type: ignore[arg-type]
    why = staged_ineligible(dense, dense, local_ring=None, remote_ring=RING, **kw)  # type: ignore[arg-type]
    assert why is not None and "staging_chunks" in why
    why = staged_ineligible(dense, dense, local_ring=RING, remote_ring=None, **kw)  # type: ignore[arg-type]
    assert why is not None and "p:1" in why
    why = staged_ineligible(
        dense, dense, local_ring=RING, remote_ring=RING, local_tp_size=1, remote_tp_size=2, peer="p"
    )
    assert why is not None and "TP sizes differ" in why
    hnd = preset("dense:num_blocks=8,layout=HND")
    why = staged_ineligible(dense, hnd, local_ring=RING, remote_ring=RING, **kw)  # type: ignore[arg-type]
    assert why is not None and "permute" in why
    small = RingInfo(1, 1 << 20, 2, 0)  # a dense row is 2 MiB
    why = staged_ineligible(dense, dense, local_ring=RING, remote_ring=small, **kw)  # type: ignore[arg-type]
    assert why is not None and "staging_chunk_bytes" in why


def test_row_bytes_per_group() -> None:
    assert group_row_bytes(preset("dense:num_blocks=8")) == [32 * 65536]
    assert len(group_row_bytes(preset("hybrid"))) == 2


@given(
    counts=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    rows=st.lists(st.integers(1, 5000), min_size=4, max_size=4),
    chunk=st.integers(5000, 40000),
)
def test_chunks_cover_every_row_once_in_order_and_fit(
    counts: list[int], rows: list[int], chunk: int
) -> None:
    rows = rows[: len(counts)]
    chunks = split_chunks(counts, rows, chunk)
    seen: dict[int, int] = dict.fromkeys(range(len(counts)), 0)
    for i, c in enumerate(chunks):
        assert c.index == i
        assert 0 < c.nbytes <= chunk
        assert c.nbytes == sum(s.rows * rows[s.group] for s in c.spans)
        groups = [s.group for s in c.spans]
        assert groups == sorted(groups) and len(set(groups)) == len(groups)
        for s in c.spans:
            assert s.start == seen[s.group] and s.stop > s.start
            seen[s.group] = s.stop
    assert seen == dict(enumerate(counts))
    # Greedy: a chunk is cut only when the next row would not fit.
    for a, b in itertools.pairwise(chunks):
        nxt = b.spans[0]
        assert a.nbytes + rows[nxt.group] > chunk


def test_a_row_larger_than_a_slot_is_refused_with_a_fix() -> None:
    with pytest.raises(InvalidRequest, match="staging_chunk_bytes"):
        split_chunks([1], [100], 99)


def test_span_offsets_and_ring_slots() -> None:
    assert span_offsets([2, 0, 3], [10, 7, 5]) == ([0, 20, 20], 35)
    assert RING.slot_offset(3) == 3 * (64 << 20)
    assert RING.row() == (1 << 20, 8 * (64 << 20), 0)
    with pytest.raises(InvalidRequest, match="slot 8"):
        RING.slot_offset(8)
