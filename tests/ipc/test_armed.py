"""A KERNEL pull's copy armed before its lease is confirmed (kvxferd.ipc.armed; CPU twin, fake
mappings): nothing is read until the decision point opens the gate; an aborted or never released
copy never reads a byte; the slot and the mappings it held go back once its work ended; a pull
confirmed against another generation copies from that one; no free slot means no arming, and
the pull launches after its confirmation as before. The GPU's gates (cuda/gates.cu) are tested in
tests/ipc/test_gpu.py."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from kvxferd.blocks import plan_pull
from kvxferd.blocks.ranges import PullPlan
from kvxferd.ipc.armed import ABORTED, OPEN, ArmedState, GateSlots, TwinGates
from kvxferd.ipc.mapping import MappingCache
from kvxferd.ipc.publish import IpcPool
from kvxferd.ipc.reader import KernelJob, KernelReader
from kvxferd.layout.presets import preset
from kvxferd.pool import KVPool
from kvxferd.transfer.state import TransferStatus
from tests.ipc.fakes import FakeHost, export_pool, ordinal_of

SPEC = "dense:num_blocks=64,num_layers=3,num_kv_heads=2,head_size=16,block_size=4"
LOCAL, REMOTE = [1, 2, 7], [3, 5, 60]


def _pool(seed: int) -> KVPool:
    pool = KVPool.allocate(preset(SPEC))
    pool.fill_pattern(0, list(range(pool.spec.num_kernel_blocks(0))), seed=seed)
    return pool


def _key(generation: int = 1) -> tuple[str, str, int]:
    return ("owner-agent", "i1", generation)


def _job(ipc: IpcPool, generation: int = 1) -> KernelJob:
    return KernelJob(
        "t1", "owner-agent", "127.0.0.1:1", _key(generation), ipc, time.monotonic() + 30
    )


def _setup() -> tuple[FakeHost, KVPool, KVPool, KernelReader, IpcPool, PullPlan]:
    host = FakeHost()
    owner, pool = _pool(3), _pool(9)
    ipc = export_pool(host, owner, "gen1")
    cache = MappingCache(device=0, opener=host.open, ordinal_of=ordinal_of)
    reader = KernelReader(pool, cache, max_ctas=4, piece_bytes=1 << 10)
    plan = plan_pull(owner.spec, owner.spec, [LOCAL], [REMOTE], prefix_caching=False)
    return host, owner, pool, reader, ipc, plan


async def _until_free(slots: GateSlots, n: int) -> None:
    for _ in range(1000):
        if slots.live == n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{slots.live} slots still live")


def test_nothing_is_read_before_the_gate_opens_and_the_pull_only_waits() -> None:
    _, owner, pool, reader, ipc, plan = _setup()
    before = pool.checksums(0, LOCAL)
    part = plan.per_rank[0]
    ready = reader.ready(_key(), ipc, part)
    assert ready is not None and ready.armed is not None
    assert ready.armed.state is ArmedState.ARMED
    assert pool.checksums(0, LOCAL) == before  # armed: queued, not run
    reader.release(ready, _key())
    assert ready.armed.state is ArmedState.OPEN
    result = asyncio.run(reader.pull(_job(ipc), part, plan.local_kernel_blocks, ready))
    assert result.status is TransferStatus.DONE, result.reason
    assert reader.last.armed and reader.last.ready
    assert pool.checksums(0, LOCAL) == owner.checksums(0, REMOTE)
    assert ready.armed.state is ArmedState.ENDED and ready.maps.users == 0


def test_a_disarmed_copy_never_reads_and_gives_its_slot_and_mappings_back() -> None:
    host, _, pool, reader, ipc, plan = _setup()
    before = pool.checksums(0, LOCAL)
    ready = reader.ready(_key(), ipc, plan.per_rank[0])
    assert ready is not None and ready.armed is not None
    assert ready.maps.users == 1  # held for the armed copy

    async def refuse() -> None:
        reader.disarm(ready)  # the confirmation failed, or the pull was cancelled
        reader.disarm(ready)  # idempotent: every path of a pull calls it

    asyncio.run(refuse())
    assert ready.armed.state is ArmedState.ENDED
    assert pool.checksums(0, LOCAL) == before
    assert ready.maps.users == 0
    reader.release(ready, _key())  # too late: an ended copy stays ended
    assert pool.checksums(0, LOCAL) == before
    reader.forget("owner-agent", "test")
    assert host.open_now == 0  # nothing kept the mappings open


def test_release_against_another_generation_aborts_and_the_pull_copies_from_it() -> None:
    """The confirmation found generation 2 (the owner re-registered with other bytes): the copy
    armed against generation 1's mappings must not run; the pull reads generation 2."""
    host, _, pool, reader, ipc1, plan = _setup()
    second = _pool(17)
    ipc2 = export_pool(host, second, "gen2")
    part = plan.per_rank[0]
    ready = reader.ready(_key(1), ipc1, part)
    assert ready is not None and ready.armed is not None

    async def run() -> TransferStatus:
        reader.release(ready, _key(2))
        assert ready.armed is not None and ready.armed.state is not ArmedState.OPEN
        result = await reader.pull(_job(ipc2, 2), part, plan.local_kernel_blocks, ready)
        return result.status

    assert asyncio.run(run()) is TransferStatus.DONE
    assert not reader.last.armed
    assert pool.checksums(0, LOCAL) == second.checksums(0, REMOTE)


def test_a_ready_pull_never_released_launches_itself_and_drops_the_armed_copy() -> None:
    _, owner, pool, reader, ipc, plan = _setup()
    part = plan.per_rank[0]
    ready = reader.ready(_key(), ipc, part)
    assert ready is not None and ready.armed is not None
    result = asyncio.run(reader.pull(_job(ipc), part, plan.local_kernel_blocks, ready))
    assert result.status is TransferStatus.DONE
    assert not reader.last.armed and reader.last.ready
    assert ready.armed.state is ArmedState.ENDED
    assert pool.checksums(0, LOCAL) == owner.checksums(0, REMOTE)


def test_with_every_slot_armed_a_pull_is_prepared_unarmed() -> None:
    _, owner, pool, reader, ipc, plan = _setup()
    part = plan.per_rank[0]
    held = [reader.ready(_key(), ipc, part) for _ in range(4)]
    assert all(r is not None and r.armed is not None for r in held)
    extra = reader.ready(_key(), ipc, part)
    assert extra is not None and extra.armed is None  # host work ahead, launched later

    async def run() -> TransferStatus:
        for r in held:
            assert r is not None
            reader.disarm(r)
        reader.release(extra, _key())  # nothing armed: a no-op
        result = await reader.pull(_job(ipc), part, plan.local_kernel_blocks, extra)
        return result.status

    assert asyncio.run(run()) is TransferStatus.DONE
    assert pool.checksums(0, LOCAL) == owner.checksums(0, REMOTE)
    again = reader.ready(_key(), ipc, part)
    assert again is not None and again.armed is not None  # the slots came back


def test_closing_the_reader_aborts_what_is_armed() -> None:
    _, _, pool, reader, ipc, plan = _setup()
    before = pool.checksums(0, LOCAL)
    ready = reader.ready(_key(), ipc, plan.per_rank[0])
    assert ready is not None and ready.armed is not None
    reader.close()
    assert ready.armed.state is ArmedState.ENDED
    assert pool.checksums(0, LOCAL) == before


def test_gate_slots_hand_out_each_slot_once_and_take_it_back_after_it_ended() -> None:
    slots = GateSlots(TwinGates(2))
    _, _, _, reader, ipc, plan = _setup()
    ready = reader.ready(_key(), ipc, plan.per_rank[0])
    assert ready is not None
    copy = ready.copy
    reader.disarm(ready)
    a = slots.arm(copy, 0, contextlib.ExitStack())
    b = slots.arm(copy, 0, contextlib.ExitStack())
    assert a is not None and b is not None and a.slot != b.slot
    assert slots.arm(copy, 0, contextlib.ExitStack()) is None
    with pytest.raises(RuntimeError, match="before its gate opened"):
        a.synchronize()  # a closed gate's wait would never end
    assert not a.query()
    a.abort()
    a.open()  # no-op: an aborted gate never opens
    assert a.state is ArmedState.ABORTED and a.query()
    slots.finish(a)
    assert slots.live == 1
    c = slots.arm(copy, 0, contextlib.ExitStack())
    assert c is not None and c.slot == a.slot

    async def reap() -> None:
        slots.reap(b)
        slots.reap(c)
        await _until_free(slots, 0)

    asyncio.run(reap())
    assert (OPEN, ABORTED) == (1, 2)  # cuda/gates.h: kGateOpen, kGateAborted
