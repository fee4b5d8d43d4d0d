"""A KERNEL pull's host work done ahead, while its lease confirmation is in flight
(:meth:`KernelReader.ready`; CPU twin, fake mappings): a pull given it only launches and copies
the right bytes; one whose mappings changed meanwhile (a new peer generation), or of another
plan, does the work again against what it reads; work that cannot be done ahead (out of
bounds, too big to run inline) is left to the pull, which fails or runs as before."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from kvxferd.blocks import plan_pull
from kvxferd.blocks.ranges import PullPlan, RegionRanges, TransferPlan
from kvxferd.errors import BlockRangeError
from kvxferd.ipc import reader as reader_module
from kvxferd.ipc.mapping import MappingCache
from kvxferd.ipc.publish import IpcPool, IpcRegion
from kvxferd.ipc.reader import KernelJob, KernelReader
from kvxferd.layout.presets import preset
from kvxferd.pool import KVPool
from kvxferd.transfer.state import TransferStatus
from tests.ipc.fakes import FakeHost, export_pool, ordinal_of

SPEC = "dense:num_blocks=64,num_layers=3,num_kv_heads=2,head_size=16,block_size=4"


def _owner(seed: int) -> KVPool:
    spec = preset(SPEC)
    pool = KVPool.allocate(spec)
    pool.fill_pattern(0, list(range(spec.num_kernel_blocks(0))), seed=seed)
    return pool


def _key(generation: int) -> tuple[str, str, int]:
    return ("owner-agent", "i1", generation)


def _setup() -> tuple[FakeHost, KVPool, KVPool, KernelReader, IpcPool, PullPlan]:
    host = FakeHost()
    owner, pool = _owner(3), _owner(9)
    ipc = export_pool(host, owner, "gen1")
    cache = MappingCache(device=0, opener=host.open, ordinal_of=ordinal_of)
    reader = KernelReader(pool, cache, max_ctas=4, piece_bytes=1 << 10)
    plan = plan_pull(owner.spec, owner.spec, [[1, 2, 7]], [[3, 5, 60]], prefix_caching=False)
    return host, owner, pool, reader, ipc, plan


def _no_host_work(*_: object) -> None:
    raise AssertionError("the pull cut its pieces again instead of using what was ready")


def _job(ipc: IpcPool, generation: int = 1) -> KernelJob:
    return KernelJob(
        "t1", "owner-agent", "127.0.0.1:1", _key(generation), ipc, time.monotonic() + 30
    )


def test_a_ready_pull_only_launches_and_copies_the_owners_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, owner, pool, reader, ipc, plan = _setup()
    part = plan.per_rank[0]
    ready = reader.ready(_key(1), ipc, part)
    assert ready is not None and ready.copy.pieces > 0 and ready.runs > 0
    monkeypatch.setattr(reader, "_pieces", _no_host_work)
    result = asyncio.run(reader.pull(_job(ipc), part, plan.local_kernel_blocks, ready))
    assert result.status is TransferStatus.DONE, result.reason
    assert result.descriptors == ready.runs
    last = reader.last
    assert last.ready and (last.cut, last.check) == (ready.cut, ready.check)
    assert pool.checksums(0, [1, 2, 7]) == owner.checksums(0, [3, 5, 60])


def test_a_pull_from_a_new_generation_does_the_work_again_against_it() -> None:
    """ready() checked the pieces against generation 1's mappings; the confirmation found
    generation 2 (the owner re-registered, here with other bytes): the pull must copy from
    generation 2, never through tables built for generation 1."""
    host, _, pool, reader, ipc1, plan = _setup()
    second = _owner(17)
    ipc2 = export_pool(host, second, "gen2")
    part = plan.per_rank[0]
    ready = reader.ready(_key(1), ipc1, part)
    assert ready is not None
    result = asyncio.run(reader.pull(_job(ipc2, 2), part, plan.local_kernel_blocks, ready))
    assert result.status is TransferStatus.DONE, result.reason
    assert not reader.last.ready
    assert pool.checksums(0, [1, 2, 7]) == second.checksums(0, [3, 5, 60])


def test_work_done_for_another_plan_is_not_used() -> None:
    _, owner, pool, reader, ipc, plan = _setup()
    other = plan_pull(owner.spec, owner.spec, [[4]], [[9]], prefix_caching=False)
    ready = reader.ready(_key(1), ipc, other.per_rank[0])
    assert ready is not None
    part = plan.per_rank[0]
    result = asyncio.run(reader.pull(_job(ipc), part, plan.local_kernel_blocks, ready))
    assert result.status is TransferStatus.DONE and not reader.last.ready
    assert pool.checksums(0, [1, 2, 7]) == owner.checksums(0, [3, 5, 60])
    fresh = _owner(9)
    assert pool.checksums(0, [4]) == fresh.checksums(0, [4])  # the other plan never ran


def test_pieces_outside_the_mapping_are_left_to_the_pull_which_fails_with_why() -> None:
    _, owner, pool, reader, ipc, _ = _setup()
    short = list(ipc.regions)
    short[1] = IpcRegion(short[1].handle, 0, 1024, short[1].device_uuid)
    small = IpcPool(tuple(short))
    block = owner.spec.regions[0].block_len
    one = np.array([0], dtype=np.int64)
    plan = TransferPlan(
        tuple(
            RegionRanges(r, f"layer.{r}", one * 0, one * 0 + 2 * block, one * 0 + block)
            for r in range(3)
        )
    )
    assert reader.ready(_key(1), small, plan) is None
    before = pool.checksums(0, [0])
    result = asyncio.run(reader.pull(_job(small), plan, (one,), None))
    assert result.status is TransferStatus.FAILED
    assert isinstance(result.error, BlockRangeError)
    assert "src region 1, which has 1024 bytes" in result.reason
    assert pool.checksums(0, [0]) == before


def test_a_pull_too_big_to_run_inline_keeps_its_host_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, owner, pool, reader, ipc, plan = _setup()
    part = plan.per_rank[0]
    monkeypatch.setattr(reader_module, "INLINE_MAX_BYTES", part.nbytes - 1)
    assert reader.ready(_key(1), ipc, part) is None
    result = asyncio.run(reader.pull(_job(ipc), part, plan.local_kernel_blocks))
    assert result.status is TransferStatus.DONE and not reader.last.inline
    assert pool.checksums(0, [1, 2, 7]) == owner.checksums(0, [3, 5, 60])
