"""Owner side of STAGED pulls: gather leased blocks into granted slots; take slots back.

A reader's ``Gather`` (or each chunk of its ``Stage`` stream, :mod:`kvxferd.staging.stage_owner`)
names a held request and kernel block IDs per group. Every ID is checked against the pool's
kernel block counts and must be held under that request's lease: nothing outside the pool,
and nothing not leased, is ever copied. The gather runs in a worker thread (on CUDA, on a side
stream with an event wait; a Stage stream's small chunks on the loop, :mod:`.inline`), and the
slot is answered (:meth:`StagingOwner.answer`) only once the bytes are there. A granted
slot returns to the ring when the reader releases it, when the request's lease ends (released
or expired: the reader is done or gone), or after the grant timeout.

Slots are shared fairly between readers (a reader is an opaque identity string; the service
decides what it is), as docs/strategies.md ("Sharing an owner's ring between readers") says:

* **per-reader cap**: one reader holds at most ``reader_cap`` slots at once (half the ring, at
  least one); a reader at its cap waits, up to its deadline, for one of *its own* slots to come
  back and times out with ``ResourceExhausted`` saying so;
* **fair order**: when no slot is free, waiting gathers queue per reader and freed slots go
  round-robin over the readers that wait and are under their cap (:mod:`.fair`).

The owner side waits on the ring (shared with this daemon's own reader chunks) through at most
one :meth:`~kvxferd.staging.ring.StagingRing.claim` at a time, made only while some waiting
reader could take a slot. Event-loop only, like the ring.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from kvxferd.errors import EngineDetached, InvalidRequest, LeaseRefused
from kvxferd.logs import kv
from kvxferd.pool import KVPool
from kvxferd.staging.chunks import span_offsets
from kvxferd.staging.device import Int64Array, PoolCopier
from kvxferd.staging.fair import REPLY_MARGIN_S, FairQueue, Waiter, waited_in_vain
from kvxferd.staging.gather_check import check_chunk_bytes, check_gather
from kvxferd.staging.grant import Grant, Held
from kvxferd.staging.ring import StagingRing, half_cap
from kvxferd.staging.stats import Occupancy
from kvxferd.transfer.leases import LeaseTable, Released

log = logging.getLogger(__name__)


class StagingOwner:
    """Grants slots of ``ring`` to readers of requests held in ``leases``, at most
    ``reader_cap`` (default: half the ring) per reader, round-robin over waiting readers."""

    def __init__(
        self,
        ring: StagingRing,
        pool: KVPool,
        leases: LeaseTable,
        *,
        grant_timeout_s: float,
        max_block_ids: int,
        reader_cap: int | None = None,
    ) -> None:
        self.ring = ring
        self.pool = pool
        self.leases = leases
        self.grant_timeout_s = grant_timeout_s
        self.max_block_ids = max_block_ids
        chunks = ring.info.chunks
        self.reader_cap = half_cap(chunks) if reader_cap is None else reader_cap
        if not 1 <= self.reader_cap <= chunks:
            raise InvalidRequest(
                f"a per-reader cap of {self.reader_cap} staging slots does not fit a ring of"
                f" {chunks}",
                field="reader_cap",
                fix="use a cap between 1 and the ring's slot count (default: half the ring)",
            )
        self.copier = PoolCopier(pool)
        self._grants: dict[int, Held] = {}
        self._count: dict[str, int] = {}  # reader -> slots granted to it (busy ones included)
        self._waiting = FairQueue(self.reader_cap, lambda reader: self._count.get(reader, 0))
        self._claim: asyncio.Future[int] | None = None  # our one wait on the ring
        self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ended: Callable[[Released], None] | None = None
        self.streams: dict[str, int] = {}  # reader -> its open Stage streams (.stage_owner)

    def start(self) -> None:
        """Reclaim slots when leases end (callbacks arrive on any thread)."""
        loop = asyncio.get_running_loop()
        self._loop = loop

        def ended(rel: Released) -> None:
            loop.call_soon_threadsafe(self._lease_ended, rel.request_id)

        self._ended = ended
        self.leases.subscribe(ended)

    def stop(self) -> None:
        """Stop following lease ends (the pool went away) and fail the Gathers still waiting;
        grants still out come back to the ring through their timeout or release, since the
        ring outlives this owner."""
        if self._ended is not None:
            self.leases.unsubscribe(self._ended)
            self._ended = None
        self._stopped = True
        self._cancel_claim()
        for w in self._waiting.all():
            self._fail(
                w,
                EngineDetached(
                    "the engine's pool went away while this Gather waited for a staging slot",
                    fix="hold the request again once the engine is attached, and retry",
                ),
            )

    @property
    def granted(self) -> int:
        return len(self._grants)

    async def idle(self) -> None:
        """Once no gather reads the pool (after :meth:`stop`; the detach drops it next)."""
        while any(h.busy for h in self._grants.values()):
            await asyncio.sleep(0.001)

    def occupancy(self) -> Occupancy:
        """Slots granted per reader, Gathers waiting per reader, free slots (a copy; cheap:
        ``O(readers)``, no lock, no device work)."""
        return Occupancy(
            slots=self.ring.info.chunks,
            free=self.ring.free_slots,
            reader_cap=self.reader_cap,
            granted={r: n for r, n in self._count.items() if n > 0},
            waiting=self._waiting.counts(),
            local=max(0, self.ring.taken_slots - len(self._grants)),
        )

    def _lease_blocks(self, request_id: str) -> tuple[Int64Array, ...] | None:
        """The kernel blocks held under ``request_id``, or None when it is not held."""
        lease = self.leases.get(request_id)
        return None if lease is None else lease.kernel_blocks

    def check(self, request_id: str, kernel_ids: Sequence[Sequence[int]]) -> list[Int64Array]:
        """``kernel_ids`` as arrays once every ID is inside the pool and held under the lease."""
        return check_gather(
            self.pool.spec,
            self._lease_blocks(request_id),
            request_id,
            kernel_ids,
            max_block_ids=self.max_block_ids,
        )

    async def gather(
        self,
        request_id: str,
        reader: str,
        kernel_ids: Sequence[Sequence[int]],
        *,
        release: Sequence[int] = (),
        timeout_s: float | None = None,
    ) -> Grant:
        """Check, wait for a slot (up to ``timeout_s``, less a reply margin), gather, answer
        the slot. ``reader`` is an opaque identity: caps and turns are per distinct string."""
        self.release(request_id, reader, release)
        ids = self.check(request_id, kernel_ids)
        _, total = span_offsets([int(a.size) for a in ids], self.copier.row_bytes)
        check_chunk_bytes(total, self.ring.info.chunk_bytes)
        return await self.fill(request_id, reader, ids, total, timeout_s)

    async def fill(
        self,
        request_id: str,
        reader: str,
        ids: Sequence[Int64Array],
        total: int,
        timeout_s: float | None,
    ) -> Grant:
        """Gather checked ``ids`` (``total`` bytes, fitting a slot) into a slot granted to
        ``reader`` once one is free for it (fair order, its cap); cancelling it while the
        gather runs frees the slot when the gather thread ends."""
        t0 = time.monotonic()
        slot = await self._acquire(request_id, reader, timeout_s)
        waited = time.monotonic() - t0
        held = self._grants[slot]
        started: list[float] = []

        def run() -> float:
            started.append(time.monotonic())
            return self.copier.gather(ids, self.ring.view(slot, total))

        work = asyncio.ensure_future(asyncio.to_thread(run))
        try:
            seconds = await asyncio.shield(work)
        except asyncio.CancelledError:
            # The caller went away; the thread still writes the slot: free it when it ends.
            held.revoked = "the caller went away"
            work.add_done_callback(lambda _: self._drop(slot))
            raise
        except BaseException:
            self._drop(slot)
            raise
        at = started[0] if started else t0
        return self.answer(request_id, slot, total, seconds=seconds, waited=waited, at=at)

    def answer(
        self, request_id: str, slot: int, total: int, *, seconds: float, waited: float, at: float
    ) -> Grant:
        """The gather into granted ``slot`` (started at monotonic ``at``) has ended: the grant,
        or, if the slot was taken back meanwhile, the slot freed and LeaseRefused saying why."""
        held = self._grants[slot]
        held.busy = False
        ended = self._lease_blocks(request_id) is None
        if held.revoked or ended:
            self._drop(slot)
            why = held.revoked or "the lease ended"
            raise LeaseRefused(
                f"staging slot {slot} for {request_id!r} was taken back during the gather"
                f" ({why}; the gather took {seconds:.3f}s)",
                field="request_id",
                fix="hold the request again and retry the pull; if the reader's share lapsed,"
                " check that it heartbeats (peers.heartbeat_interval_ms < heartbeat_timeout_ms)",
            )
        # The grant timeout counts from now, when the reader can start reading the slot: a slow
        # gather (a busy GPU) never eats the reader's time to read it.
        held.timer = asyncio.get_running_loop().call_later(self.grant_timeout_s, self._expire, slot)
        return Grant(slot, self.ring.info.slot_offset(slot), total, seconds, waited, at)

    def abandon(self, slot: int) -> None:  # free granted ``slot`` unanswered, once unwritten
        self._drop(slot)

    def release(self, request_id: str, reader: str, slots: Sequence[int]) -> int:
        """Free ``slots`` granted to ``reader`` for ``request_id``; others are ignored."""
        n = 0
        for s in slots:
            h = self._grants.get(int(s))
            if h is not None and not h.busy and (h.request_id, h.reader) == (request_id, reader):
                self._drop(int(s))
                n += 1
        return n

    def release_reader(self, reader: str) -> int:
        """Take back every slot granted to ``reader`` and fail its waiting Gathers (the reader
        restarted or was evicted); returns how many slots it held. A slot still being gathered
        into returns when its gather ends."""
        mine = [slot for slot, h in self._grants.items() if h.reader == reader]
        for slot in mine:
            self._reclaim(slot, "reader gone")
        for w in self._waiting.of(reader):
            self._fail(
                w,
                LeaseRefused(
                    f"reader {reader!r} was replaced or evicted while this Gather waited",
                    fix="handshake again and retry the pull",
                ),
            )
        return len(mine)

    # -- granting -------------------------------------------------------------------------------

    async def _acquire(self, request_id: str, reader: str, timeout_s: float | None) -> int:
        """A slot granted to ``reader`` (registered, busy): at once when one is free, the
        reader is under its cap and no reader that could take it waits; else in turn."""
        if self._stopped:
            raise EngineDetached(
                "this staging owner was stopped (the engine's pool went away)",
                fix="hold the request again once the engine is attached, and retry",
            )
        slot = self.try_grant(request_id, reader)
        if slot is not None:
            return slot
        loop = asyncio.get_running_loop()
        w = Waiter(request_id, reader, loop.create_future())
        self._waiting.push(w)
        timer = None
        if timeout_s is not None:
            wait_s = max(0.0, timeout_s - min(REPLY_MARGIN_S, timeout_s / 10))
            timer = loop.call_later(wait_s, self._time_out, w, wait_s)
        self._pump()
        try:
            return await w.fut
        except asyncio.CancelledError:
            if w.fut.done() and not w.fut.cancelled() and w.fut.exception() is None:
                self._drop(w.fut.result())  # granted just as the caller went away
            else:
                self._unqueue(w)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def try_grant(self, request_id: str, reader: str) -> int | None:
        """A slot granted to ``reader`` now (busy until :meth:`answer`), or None where a
        gather would wait: none free, the reader at its cap, or another reader's turn."""
        if self._stopped or self._count.get(reader, 0) >= self.reader_cap:
            return None
        if self._waiting.eligible() is not None:
            return None
        slot = self.ring.try_take()
        if slot is not None:
            self._grant(slot, request_id, reader)
        return slot

    def _grant(self, slot: int, request_id: str, reader: str) -> None:
        self._grants[slot] = Held(request_id, reader)  # its grant timeout starts at the answer
        self._count[reader] = self._count.get(reader, 0) + 1

    def _unqueue(self, w: Waiter) -> None:
        self._waiting.remove(w)
        self._pump()

    def _fail(self, w: Waiter, err: BaseException) -> None:
        if w.fut.done():
            return
        self._unqueue(w)
        w.fut.set_exception(err)

    def _pump(self) -> None:
        """Hold one claim on the ring exactly while some waiting reader could take a slot."""
        want = not self._stopped and self._waiting.eligible() is not None
        if want and self._claim is None:
            claim = self.ring.claim()
            self._claim = claim
            claim.add_done_callback(self._claimed)
        elif not want:
            self._cancel_claim()

    def _cancel_claim(self) -> None:
        claim = self._claim
        if claim is not None and not claim.done():
            self._claim = None
            claim.cancel()

    def _claimed(self, claim: asyncio.Future[int]) -> None:
        if claim.cancelled():
            if claim is self._claim:
                self._claim = None
                self._pump()
            return
        slot = claim.result()
        if claim is self._claim:
            self._claim = None
        w = None if self._stopped else self._waiting.pop_next()
        if w is None:
            self.ring.give(slot)  # nobody can take it any more: to the next ring waiter
        else:
            self._grant(slot, w.request_id, w.reader)
            w.fut.set_result(slot)
        self._pump()

    def _time_out(self, w: Waiter, timeout_s: float) -> None:
        held = self._count.get(w.reader, 0)
        occ = self.occupancy()
        self._fail(w, waited_in_vain(w.reader, held, self.reader_cap, timeout_s, occ))

    # -- taking slots back ----------------------------------------------------------------------

    def _drop(self, slot: int) -> None:
        h = self._grants.pop(slot, None)
        if h is not None:
            if h.timer is not None:
                h.timer.cancel()
            n = self._count.get(h.reader, 0) - 1
            if n > 0:
                self._count[h.reader] = n
            else:
                self._count.pop(h.reader, None)
            self.ring.give(slot)
            self._pump()  # the reader may be under its cap again

    def _reclaim(self, slot: int, why: str) -> None:
        h = self._grants.get(slot)
        if h is None:
            return
        log.info(
            "staging slot reclaimed",
            extra=kv(slot=slot, request_id=h.request_id, reader=h.reader, reason=why),
        )
        if h.busy:
            h.revoked = why  # the gather thread still writes it; freed when it ends
        else:
            self._drop(slot)

    def _expire(self, slot: int) -> None:
        h = self._grants.get(slot)
        if h is not None and h.busy:
            return  # still gathering: the timeout restarts when the slot is answered
        self._reclaim(slot, f"grant timeout {self.grant_timeout_s}s")

    def _lease_ended(self, request_id: str) -> None:
        for w in [w for w in self._waiting.all() if w.request_id == request_id]:
            self._fail(
                w,
                LeaseRefused(
                    f"the lease of {request_id!r} ended while this Gather waited for a"
                    " staging slot",
                    field="request_id",
                    fix="hold the request again and retry the pull",
                ),
            )
        for slot, h in list(self._grants.items()):
            if h.request_id == request_id:
                self._reclaim(slot, "lease ended")
