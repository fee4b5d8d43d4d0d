"""The owner side of STAGED pulls on its own: per-reader cap, round-robin granting, timeouts.

No NIXL and no daemon: a CPU pool, a real lease table and the owner on one event loop. The
gathers run in worker threads as in the daemon, so waits poll the owner's occupancy view.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest

from kvxferd.errors import EngineDetached, LeaseRefused, ResourceExhausted
from kvxferd.layout.presets import preset
from kvxferd.pool import KVPool
from kvxferd.staging.owner import Grant, StagingOwner
from kvxferd.staging.ring import StagingRing
from kvxferd.staging.stats import Occupancy
from kvxferd.staging.strategy import group_row_bytes
from kvxferd.transfer.leases import LeaseTable

SPEC = "dense:num_blocks=64,num_layers=1,num_kv_heads=1,head_size=8,block_size=4"


class Rig:
    def __init__(self, chunks: int, reader_cap: int | None = None) -> None:
        spec = preset(SPEC)
        self.pool = KVPool.allocate(spec)
        self.pool.fill_pattern(0, list(range(64)), seed=1)
        self.row = group_row_bytes(spec)[0]
        self.ring = StagingRing.allocate(self.row, chunks, "cpu")
        self.leases = LeaseTable()
        self.owner = StagingOwner(
            self.ring,
            self.pool,
            self.leases,
            grant_timeout_s=60.0,
            max_block_ids=1024,
            reader_cap=reader_cap,
        )
        self.owner.start()
        self.leases.hold("req", [np.arange(64)], readers=4, ttl_s=60.0)

    def gather(
        self, reader: str, block: int = 0, *, rid: str = "req", timeout_s: float | None = 10.0
    ) -> asyncio.Task[Grant]:
        return asyncio.ensure_future(self.owner.gather(rid, reader, [[block]], timeout_s=timeout_s))

    def release(self, reader: str, grant: Grant, rid: str = "req") -> None:
        assert self.owner.release(rid, reader, [grant.slot]) == 1

    def occ(self) -> Occupancy:
        return self.owner.occupancy()

    async def until(self, what: Callable[[Occupancy], bool], timeout_s: float = 5.0) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while not what(self.occ()):
            assert loop.time() < end, f"occupancy never matched: {self.occ()}"
            await asyncio.sleep(0.002)

    def check_sums(self) -> None:
        o = self.occ()
        assert o.free + o.granted_total + o.local == o.slots, o
        assert all(n <= o.reader_cap for n in o.granted.values()), o


def waiting(n: int) -> Callable[[Occupancy], bool]:
    return lambda o: o.waiting_total == n


def run(make: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(make())


def test_cap_is_half_the_ring_at_least_one() -> None:
    async def go() -> None:
        assert Rig(8).owner.reader_cap == 4
        assert Rig(5).owner.reader_cap == 2
        assert Rig(2).owner.reader_cap == 1
        assert Rig(4, reader_cap=3).owner.reader_cap == 3

    run(go)


def test_greedy_reader_gets_its_cap_and_another_reader_is_served_at_once() -> None:
    async def go() -> None:
        r = Rig(4)  # cap 2
        greedy = [r.gather("A", b) for b in range(4)]  # A asks for the whole ring
        await r.until(lambda o: o.granted.get("A") == 2 and o.waiting.get("A") == 2)
        assert r.occ().free == 2
        while sum(g.done() for g in greedy) < 2:
            await asyncio.sleep(0.002)
        b1 = await asyncio.wait_for(r.gather("B", 10), 1.0)  # not stalled behind A
        b2 = await asyncio.wait_for(r.gather("B", 11), 1.0)
        assert {b1.slot, b2.slot}.isdisjoint({g.result().slot for g in greedy if g.done()})
        o = r.occ()
        assert o.granted == {"A": 2, "B": 2} and o.free == 0 and o.waiting == {"A": 2}
        r.check_sums()
        # B reading does not hand A more than its cap: B's released slot stays free.
        r.release("B", b1)
        await asyncio.sleep(0.05)
        assert r.occ().granted == {"A": 2, "B": 1} and r.occ().free == 1
        # A releasing one of its own lets its next waiting Gather in, one for one.
        first = next(g for g in greedy if g.done())
        r.release("A", first.result())
        await r.until(lambda o: o.waiting.get("A") == 1)
        assert r.occ().granted == {"A": 2, "B": 1}
        for t in greedy:
            t.cancel()
        await asyncio.gather(*greedy, return_exceptions=True)

    run(go)


def test_reader_at_cap_times_out_with_a_fix() -> None:
    async def go() -> None:
        r = Rig(4)
        a = [await r.gather("A", b) for b in range(2)]
        with pytest.raises(ResourceExhausted) as ei:
            await r.gather("A", 5, timeout_s=0.05)
        text = str(ei.value)
        assert "'A' holds 2 staging slot(s)" in text and "cap (2 of the ring's 4" in text, text
        assert "release each slot as soon as it is read" in ei.value.fix
        assert r.occ().waiting == {} and r.occ().free == 2  # the free slots were not touched
        for g in a:
            r.release("A", g)
        assert r.occ().free == 4

    run(go)


def test_full_ring_times_out_saying_who_holds_it() -> None:
    async def go() -> None:
        r = Rig(4)
        for reader in ("A", "A", "B", "B"):
            await r.gather(reader)
        with pytest.raises(ResourceExhausted) as ei:
            await r.gather("C", timeout_s=0.05)
        text = str(ei.value)
        assert "no staging slot became free" in text, text
        assert "4 granted to 2 reader(s)" in text, text
        assert "staging_chunks" in ei.value.fix

    run(go)


def test_freed_slots_go_round_robin_over_waiting_readers() -> None:
    async def go() -> None:
        r = Rig(4, reader_cap=4)  # no cap in the way: order alone
        held = [await r.gather("H", b) for b in range(4)]
        order: list[str] = []

        def waiter(name: str) -> asyncio.Task[None]:
            async def one() -> None:
                await r.owner.gather("req", name[0], [[7]], timeout_s=10)
                order.append(name)

            return asyncio.ensure_future(one())

        tasks: dict[str, asyncio.Task[None]] = {}
        for name in ("a1", "a2", "a3", "b1", "c1"):  # A asks most, and first
            tasks[name] = waiter(name)
            await r.until(waiting(len(tasks)))
        for i, g in enumerate(held):
            r.release("H", g)  # one grant per release; let it finish before the next
            await r.until(waiting(4 - i))
            while len(order) < i + 1:
                await asyncio.sleep(0.002)
        await asyncio.gather(*(tasks[n] for n in ("a1", "b1", "c1", "a2")))
        assert order == ["a1", "b1", "c1", "a2"], order  # not a1, a2, a3 first
        tasks["a3"].cancel()
        await asyncio.gather(tasks["a3"], return_exceptions=True)

    run(go)


def test_reader_at_cap_is_skipped_until_its_own_slot_returns() -> None:
    async def go() -> None:
        r = Rig(4)  # cap 2
        a = [await r.gather("A", b) for b in range(2)]
        b = [await r.gather("B", b) for b in range(2, 4)]
        a3 = r.gather("A", 4)  # A, at its cap, queues first
        await r.until(lambda o: o.waiting == {"A": 1})
        c1 = r.gather("C", 5)
        await r.until(lambda o: o.waiting == {"A": 1, "C": 1})
        r.release("B", b[0])  # B's slot goes to C, not to A who queued first
        got = await asyncio.wait_for(c1, 1.0)
        assert got.slot == b[0].slot
        assert not a3.done() and r.occ().granted == {"A": 2, "B": 1, "C": 1}
        r.release("A", a[0])  # A's own slot comes back to A
        got = await asyncio.wait_for(a3, 1.0)
        assert got.slot == a[0].slot
        r.check_sums()

    run(go)


def test_cancelled_and_timed_out_waiters_leave_nothing_behind() -> None:
    async def go() -> None:
        r = Rig(2)  # cap 1
        a = await r.gather("A")
        b = await r.gather("B")
        waiting = [r.gather("C"), r.gather("C"), r.gather("A")]
        await r.until(lambda o: o.waiting_total == 3)
        waiting[0].cancel()
        with pytest.raises(ResourceExhausted):
            await r.gather("D", timeout_s=0.02)
        await asyncio.gather(waiting[0], return_exceptions=True)
        assert r.occ().waiting == {"C": 1, "A": 1}
        r.release("B", b)  # to C's remaining waiter
        c = await asyncio.wait_for(waiting[1], 1.0)
        waiting[2].cancel()
        await asyncio.gather(waiting[2], return_exceptions=True)
        r.release("A", a)
        r.release("C", c)
        assert r.occ() == Occupancy(slots=2, free=2, reader_cap=1)

    run(go)


def test_lease_end_fails_its_waiters_and_reclaims_its_slots() -> None:
    async def go() -> None:
        r = Rig(2)
        r.leases.hold("other", [np.arange(64)], readers=1, ttl_s=60.0)
        a = await r.gather("A", rid="other")
        await r.gather("B", rid="req")
        w_other = r.gather("C", rid="other")
        w_req = r.gather("D", rid="req")
        await r.until(lambda o: o.waiting_total == 2)
        r.leases.cancel("other")
        with pytest.raises(LeaseRefused, match="ended while this Gather waited"):
            await w_other
        # A's slot came back and went to D, the one waiter left.
        d = await asyncio.wait_for(w_req, 1.0)
        assert d.slot == a.slot
        assert r.occ().granted == {"B": 1, "D": 1}

    run(go)


def test_release_reader_takes_back_its_slots_and_fails_its_waiters() -> None:
    async def go() -> None:
        r = Rig(4)
        await r.gather("A")
        await r.gather("A")
        gone = r.gather("A")
        await r.until(lambda o: o.waiting == {"A": 1})
        assert r.owner.release_reader("A") == 2
        with pytest.raises(LeaseRefused, match="replaced or evicted"):
            await gone
        assert r.occ() == Occupancy(slots=4, free=4, reader_cap=2)

    run(go)


def test_stop_fails_waiters_and_refuses_new_gathers() -> None:
    async def go() -> None:
        r = Rig(2)
        await r.gather("A")
        await r.gather("B")
        w = r.gather("C")
        await r.until(lambda o: o.waiting_total == 1)
        r.owner.stop()
        with pytest.raises(EngineDetached):
            await w
        with pytest.raises(EngineDetached):
            await r.gather("C")

    run(go)


def test_owner_and_local_reader_share_the_ring_in_arrival_order() -> None:
    async def go() -> None:
        r = Rig(2, reader_cap=2)
        g1, g2 = await r.gather("A"), await r.gather("A")
        local = asyncio.ensure_future(r.ring.take())  # this daemon's own pull waits first
        await asyncio.sleep(0.01)
        remote = r.gather("B")
        await r.until(lambda o: o.waiting == {"B": 1})
        r.release("A", g1)
        slot = await asyncio.wait_for(local, 1.0)
        assert slot == g1.slot and not remote.done()
        assert r.occ().local == 1
        r.release("A", g2)
        assert (await asyncio.wait_for(remote, 1.0)).slot == g2.slot
        r.ring.give(slot)
        r.check_sums()

    run(go)


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_the_cap_and_returns_every_slot(seed: int) -> None:
    """Readers of very different appetites gather, release, give up and time out at random;
    at every step no reader is over its cap and the slots add up; at the end all are free."""

    async def go() -> None:
        rng = random.Random(seed)
        chunks = rng.choice([2, 3, 4, 8])
        r = Rig(chunks)
        served: dict[str, int] = {}

        async def reader(name: str, appetite: int, rounds: int) -> None:
            async def one(block: int) -> None:
                try:
                    g = await r.owner.gather("req", name, [[block]], timeout_s=rng.uniform(0, 0.2))
                except ResourceExhausted:
                    return
                try:
                    served[name] = served.get(name, 0) + 1
                    r.check_sums()
                    await asyncio.sleep(rng.uniform(0, 0.01))
                finally:
                    r.release(name, g)

            for _ in range(rounds):
                burst = [asyncio.ensure_future(one(rng.randrange(64))) for _ in range(appetite)]
                if rng.random() < 0.2:
                    await asyncio.sleep(rng.uniform(0, 0.01))
                    rng.choice(burst).cancel()
                await asyncio.gather(*burst, return_exceptions=True)
                r.check_sums()

        await asyncio.gather(
            reader("greedy", 3 * chunks, 6), reader("modest", 1, 30), reader("pair", 2, 15)
        )
        await r.until(lambda o: o.free == chunks)  # gathers cancelled mid-copy free on their end
        assert r.occ() == Occupancy(slots=chunks, free=chunks, reader_cap=r.owner.reader_cap)
        assert served.get("modest", 0) > 0, served

    run(go)


def test_ring_try_take_respects_waiters() -> None:
    async def go() -> None:
        ring = StagingRing.allocate(16, 2, "cpu")
        a, b = ring.try_take(), ring.try_take()
        assert a is not None and b is not None and ring.try_take() is None
        waiter = asyncio.ensure_future(ring.take())
        await asyncio.sleep(0)
        ring.give(a)  # handed to the waiter, not made free
        assert ring.free_slots == 0 and ring.try_take() is None
        assert await waiter == a
        cancelled = asyncio.ensure_future(ring.take())
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        ring.give(b)
        ring.give(a)
        assert ring.free_slots == 2 and ring.taken_slots == 0

    run(go)
