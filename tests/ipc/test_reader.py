"""KERNEL pulls on CPU (the torch twin copies; fake mappings): the bytes of the owner's blocks
land in the reader's blocks for dense, hybrid and MLA specs; pieces equal DIRECT's runs; bounds
are checked against the mapped sizes before anything is copied; a copy that ends after the
deadline is EXPIRED."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from kvxferd.blocks import plan_pull
from kvxferd.blocks.ranges import RegionRanges, TransferPlan
from kvxferd.errors import BlockRangeError
from kvxferd.ipc.mapping import MappingCache
from kvxferd.ipc.pieces import piece_size, pieces
from kvxferd.ipc.publish import IpcPool, IpcRegion
from kvxferd.ipc.reader import KernelJob, KernelReader
from kvxferd.layout.presets import preset
from kvxferd.pool import KVPool
from kvxferd.transfer.state import TransferStatus
from tests.ipc.fakes import FakeHost, export_pool, ordinal_of

SPECS = {
    "dense": "dense:num_blocks=64,num_layers=3,num_kv_heads=2,head_size=16,block_size=4",
    "hybrid": "hybrid:num_blocks=6,ppl=4,attention_layers=2,mamba_layers=2,head_size=16",
    "mla": "mla:num_blocks=32,num_layers=3,latent_dim=64,block_size=4",
}


def _pools(spec_text: str) -> tuple[KVPool, KVPool]:
    spec = preset(spec_text)
    owner, reader = KVPool.allocate(spec), KVPool.allocate(spec)
    for g in range(len(spec.groups)):
        owner.fill_pattern(g, list(range(spec.num_kernel_blocks(g))), seed=3)
        reader.fill_pattern(g, list(range(spec.num_kernel_blocks(g))), seed=9)
    return owner, reader


def _reader(host: FakeHost, pool: KVPool) -> KernelReader:
    cache = MappingCache(device=0, opener=host.open, ordinal_of=ordinal_of)
    return KernelReader(pool, cache, max_ctas=4, piece_bytes=1 << 10)


def _job(ipc: IpcPool, *, deadline_s: float = 30.0, generation: int = 1) -> KernelJob:
    return KernelJob(
        "t1",
        "owner-agent",
        "127.0.0.1:1",
        ("owner-agent", "i1", generation),
        ipc,
        time.monotonic() + deadline_s,
    )


@pytest.mark.parametrize("name", sorted(SPECS))
def test_kernel_pull_copies_the_owners_blocks(name: str) -> None:
    owner, reader_pool = _pools(SPECS[name])
    spec = owner.spec
    host = FakeHost()
    ipc = export_pool(host, owner, "own")
    rng = np.random.default_rng(5)
    local_ids, remote_ids = [], []
    for g, group in enumerate(spec.groups):
        n = spec.num_kernel_blocks(g) if group.kind.is_state else spec.num_logical_blocks(g)
        k = min(5, n)
        local_ids.append(rng.choice(n, k, replace=False))
        remote_ids.append(rng.choice(n, k, replace=False))
    plan = plan_pull(spec, spec, local_ids, remote_ids, prefix_caching=False)
    part = plan.per_rank[0]
    reader = _reader(host, reader_pool)
    result = asyncio.run(reader.pull(_job(ipc), part, plan.local_kernel_blocks))
    assert result.status is TransferStatus.DONE, result.reason
    assert result.nbytes == part.nbytes > 0
    for g in range(len(spec.groups)):
        got = reader_pool.checksums(g, plan.local_kernel_blocks[g].tolist())
        want = owner.checksums(g, plan.remote_kernel_blocks[g].tolist())
        assert got == want
    # Blocks outside the pull are untouched.
    other = [b for b in range(spec.num_kernel_blocks(0)) if b not in plan.local_kernel_blocks[0]]
    fresh = KVPool.allocate(spec)
    fresh.fill_pattern(0, other, seed=9)
    assert reader_pool.checksums(0, other) == fresh.checksums(0, other)


def test_pieces_are_directs_runs_cut_to_size() -> None:
    lo = np.array([0, 100, 200, 1000], dtype=np.int64)  # 0..300 contiguous on both sides
    ro = np.array([50, 150, 250, 5000], dtype=np.int64)
    ln = np.array([100, 100, 100, 2500], dtype=np.int64)
    plan = TransferPlan((RegionRanges(2, "r", lo, ro, ln),))
    # Runs of 300 and 2500 bytes: 1 KiB pieces (4 slots) cost less than 512 B ones (6 slots).
    assert piece_size(np.array([300, 2500], dtype=np.int64), 1024) == 1024
    rc, runs = pieces(plan, piece_bytes=1024)
    assert runs == 2  # what DIRECT posts after coalescing
    assert rc.nbytes == 2800 and int(rc.length.max()) <= 1024
    assert set(rc.region.tolist()) == {2}
    assert rc.dst_offset.tolist() == [0, 1000, 2024, 3048]
    assert rc.src_offset.tolist() == [50, 5000, 6024, 7048]
    assert rc.length.tolist() == [300, 1024, 1024, 452]


def test_bounds_are_checked_against_the_mapped_sizes_before_any_copy() -> None:
    owner, reader_pool = _pools(SPECS["dense"])
    host = FakeHost()
    ipc = export_pool(host, owner, "own")
    # The peer advertises (and we map) only the first 1 KiB of region 1: a plan reading past it
    # must fail before a single byte moves.
    short = list(ipc.regions)
    short[1] = IpcRegion(short[1].handle, 0, 1024, short[1].device_uuid)
    small = IpcPool(tuple(short))
    block = owner.spec.regions[0].block_len
    ranges = tuple(
        RegionRanges(
            r,
            f"layer.{r}",
            np.array([0], dtype=np.int64),
            np.array([2 * block], dtype=np.int64),
            np.array([block], dtype=np.int64),
        )
        for r in range(3)
    )
    before = reader_pool.checksums(0, [0])
    reader = _reader(host, reader_pool)
    local = (np.array([0]),)
    result = asyncio.run(reader.pull(_job(small), TransferPlan(ranges), local))
    assert result.status is TransferStatus.FAILED
    assert isinstance(result.error, BlockRangeError)
    assert "src region 1, which has 1024 bytes" in result.reason
    assert reader_pool.checksums(0, [0]) == before  # region 0 was not copied either
    assert [a.tolist() for a in result.invalid_blocks] == [[0]]


def test_a_copy_that_ends_after_the_deadline_is_expired() -> None:
    owner, reader_pool = _pools(SPECS["dense"])
    host = FakeHost()
    ipc = export_pool(host, owner, "own")
    plan = plan_pull(owner.spec, owner.spec, [[1, 2]], [[3, 4]], prefix_caching=False)
    reader = _reader(host, reader_pool)
    result = asyncio.run(
        reader.pull(_job(ipc, deadline_s=-1.0), plan.per_rank[0], plan.local_kernel_blocks)
    )
    assert result.status is TransferStatus.EXPIRED
    assert [a.tolist() for a in result.invalid_blocks] == [[1, 2]]


def test_a_new_peer_generation_is_mapped_afresh_and_the_old_one_dropped() -> None:
    owner, reader_pool = _pools(SPECS["dense"])
    host = FakeHost()
    ipc1 = export_pool(host, owner, "gen1")
    ipc2 = export_pool(host, owner, "gen2")
    plan = plan_pull(owner.spec, owner.spec, [[1]], [[3]], prefix_caching=False)
    reader = _reader(host, reader_pool)

    async def both() -> None:
        r1 = await reader.pull(_job(ipc1, generation=1), plan.per_rank[0], plan.local_kernel_blocks)
        r2 = await reader.pull(_job(ipc2, generation=2), plan.per_rank[0], plan.local_kernel_blocks)
        assert r1.status is r2.status is TransferStatus.DONE

    asyncio.run(both())
    assert len(host.closed) == 3 and all(h.startswith(b"gen1") for h in host.closed)
    reader.close()
    assert host.open_now == 0


def _pieces_reference(plan: TransferPlan, largest: int) -> tuple[set[tuple[int, ...]], int]:
    """Per region: DIRECT's coalescing (kvxferd.transfer.descriptors), then the cut at the
    size piece_size picks for all the runs."""
    from kvxferd.transfer.descriptors import coalesce, split_runs

    runs = [
        (rr.region, *coalesce(rr.local_offset, rr.remote_offset, rr.length))
        for rr in plan.ranges
        if rr.num_ranges
    ]
    size = piece_size(np.concatenate([r[3] for r in runs]), largest)
    out: set[tuple[int, ...]] = set()
    for region, lo, ro, ln in runs:
        regions = np.full(ln.size, region, dtype=np.int64)
        for r, a, b, n in zip(*split_runs(regions, lo, ro, ln, size), strict=True):
            out.add((int(r), int(a), int(b), int(n)))
    return out, sum(int(r[3].size) for r in runs)


@pytest.mark.parametrize("seed", range(20))
def test_vectorised_pieces_equal_per_region_coalescing(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ranges = []
    for r in rng.choice(8, int(rng.integers(1, 6)), replace=False):
        n = int(rng.integers(0, 40))
        blocks = rng.permutation(64)[:n] if seed % 2 else np.sort(rng.choice(64, n, replace=False))
        other = blocks if seed % 3 == 0 else rng.permutation(64)[:n]
        size = int(rng.choice([512, 4096]))
        ranges.append(
            RegionRanges(
                int(r),
                f"r{r}",
                (blocks * size).astype(np.int64),
                (other * size).astype(np.int64),
                np.full(n, size, dtype=np.int64),
            )
        )
    plan = TransferPlan(tuple(ranges))
    rc, runs = pieces(plan, piece_bytes=3000)
    if plan.num_ranges == 0:
        assert rc.pieces == runs == 0
        return
    got = set(
        zip(
            rc.region.tolist(),
            rc.dst_offset.tolist(),
            rc.src_offset.tolist(),
            rc.length.tolist(),
            strict=True,
        )
    )
    want, want_runs = _pieces_reference(plan, 3000)
    assert got == want and runs == want_runs and rc.pieces == len(want)


def test_regions_are_prepared_at_handshake_and_kept_per_generation() -> None:
    """prepare() maps and checks the peer's regions once; pulls of that generation reuse them
    (no per-pull validation of every region), a new generation replaces them, and the pull
    reports where its time went."""
    owner, reader_pool = _pools(SPECS["dense"])
    host = FakeHost()
    ipc1, ipc2 = export_pool(host, owner, "gen1"), export_pool(host, owner, "gen2")
    reader = _reader(host, reader_pool)
    assert reader.prepare(("owner-agent", "i1", 1), ipc1) is None
    prepared = reader._src
    assert prepared is not None and len(prepared[1]) == len(owner.spec.regions)
    plan = plan_pull(owner.spec, owner.spec, [[1, 2]], [[3, 5]], prefix_caching=False)
    part = plan.per_rank[0]
    result = asyncio.run(reader.pull(_job(ipc1), part, plan.local_kernel_blocks))
    assert result.status is TransferStatus.DONE, result.reason
    assert reader._src is prepared  # the same checked regions, not rebuilt
    last = reader.last
    assert last.pieces > 0 and last.call >= last.cut + last.launch > 0
    result = asyncio.run(reader.pull(_job(ipc2, generation=2), part, plan.local_kernel_blocks))
    assert result.status is TransferStatus.DONE, result.reason
    assert reader._src is not None and reader._src[0] is not prepared[0]
    assert reader_pool.checksums(0, [1, 2]) == owner.checksums(0, [3, 5])
    assert reader.prepare(("owner-agent", "i1", 3), IpcPool((), "not exported")) is not None
