"""Owner side of a ``Peer.Stage`` stream: one STAGED pull, chunk after chunk, as credits allow.

The reader's first message (:class:`StageOpen`) names the held request, every remote kernel
block ID of the pull and the slot size it cut its chunks at; :meth:`StageStream.open` checks
it as a Gather is checked (every ID inside the pool and held under the lease) plus the
chunking and the credits, and derives the chunks with :func:`kvxferd.staging.chunks.split_chunks`
exactly as the reader did. Then two tasks run until the stream ends:

* **work**: for each chunk in order, wait for a credit, take a slot through the owner (per-reader
  cap and fair order, shared with Gathers: :class:`~kvxferd.staging.owner.StagingOwner`),
  gather, announce (:class:`Announce`). One credit is one announced slot not yet returned.
  A small chunk with a slot free at once is gathered on the loop (:mod:`.inline`), a larger
  one (or one that waits for a slot) in the owner's worker thread.
* **returns**: each later reader message returns slots it has read; each goes back to the ring
  and gives a credit back. A slot that is not one of this stream's announced, unreturned slots
  fails the stream. The reader half-closing stops the stream. When the work waits for that
  credit, the next chunk's inline gather starts right there, without a turn of the loop.

Stopping (half-close, the call cancelled or broken, an error) cancels the work task: a gather
in progress ends (in its worker thread, or its CUDA event) and its slot returns to the ring; no
other chunk starts. Every slot the stream still holds returns to the ring when it ends.
Event-loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvxferd.errors import InvalidRequest, LeaseRefused, ResourceExhausted
from kvxferd.logs import kv
from kvxferd.staging import inline
from kvxferd.staging.chunks import Chunk, split_chunks
from kvxferd.staging.device import Int64Array
from kvxferd.staging.owner import StagingOwner
from kvxferd.transfer.leases import Released

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageOpen:
    """The pull a stream serves, as the reader's first message gave it."""

    request_id: str
    kernel_ids: Sequence[Sequence[int]]  # per group, the pull's whole remote lists
    chunk_bytes: int
    chunks: int
    credits: int


@dataclass(frozen=True)
class Announce:
    """One gathered chunk: where it lies and what it cost the owner."""

    chunk: int
    slot: int
    offset: int
    nbytes: int
    gather_s: float
    start_s: float  # control cost: ready to start (credit, previous chunk) -> gather started
    slot_wait_s: float


Send = Callable[[Announce], Awaitable[None]]
STOP_WAIT_S = 1.0  # how long a stopping stream waits for its gather/announce/return task


class StageStream:
    """One open Stage stream of ``reader`` (the caller's identity) on ``owner``."""

    def __init__(
        self,
        owner: StagingOwner,
        reader: str,
        request_id: str,
        *,
        ids: list[Int64Array],
        chunks: list[Chunk],
        credits: int,
        deadline: float | None,
    ) -> None:
        self.owner = owner
        self.reader = reader
        self.request_id = request_id
        self.ids = ids
        self.chunks = chunks
        self.credits = credits
        self.deadline = deadline  # monotonic, None: no deadline
        self.out: set[int] = set()  # announced slots not yet returned
        self.started = 0  # gathers begun
        self.inline = 0  # of which on the loop (.inline), the rest in the worker thread
        self.gathered = 0  # gathers ended into their slot
        self.announced = 0
        self.returned = 0
        self.ready_at = time.monotonic()  # when the next chunk could start, credits allowing
        self._wake = asyncio.Event()
        self._none = [a[:0] for a in ids]  # per group, no ID: a chunk's groups it skips
        self._idle = False  # the work waits for a credit
        self._early: inline.Launched | None = None  # the next chunk, gathered, not yet landed

    @classmethod
    def open(
        cls, owner: StagingOwner, reader: str, req: StageOpen, time_left_s: float | None
    ) -> StageStream:
        """Check ``req`` and build the stream; raises what was wrong (and the fix)."""
        ring = owner.ring.info
        if not 0 < req.chunk_bytes <= ring.chunk_bytes:
            raise InvalidRequest(
                f"chunk_bytes {req.chunk_bytes} is not between 1 and this ring's slot size"
                f" ({ring.chunk_bytes} bytes)",
                field="open.chunk_bytes",
                fix="cut chunks at the smaller of both rings' chunk_bytes (the handshakes')",
            )
        if not 1 <= req.credits <= owner.reader_cap:
            raise InvalidRequest(
                f"{req.credits} credits: a reader may hold 1 to {owner.reader_cap} staging"
                f" slots here (half of this ring's {ring.chunks}, at least one)",
                field="open.credits",
                fix=f"ask for at most {owner.reader_cap} credits (half the advertised ring)",
            )
        ids = owner.check(req.request_id, req.kernel_ids)
        counts = [int(a.size) for a in ids]
        chunks = split_chunks(counts, owner.copier.row_bytes, req.chunk_bytes)
        if not chunks or len(chunks) != req.chunks:
            raise InvalidRequest(
                f"these IDs cut at {req.chunk_bytes} bytes make {len(chunks)} chunk(s) here,"
                f" the reader says {req.chunks}",
                field="open.chunks",
                fix="the peers disagree on the staging layout (or the pull is empty): run"
                " the same kvxferd version on both",
            )
        deadline = None if time_left_s is None else time.monotonic() + time_left_s
        return cls(
            owner,
            reader,
            req.request_id,
            ids=ids,
            chunks=chunks,
            credits=req.credits,
            deadline=deadline,
        )

    async def run(self, returns: AsyncIterator[Sequence[int]], send: Send) -> None:
        """Serve the pull until every chunk was announced and returned, or the reader stops
        (``returns`` ends: OK), or something fails (raised). Cancelling it stops it too. A
        reader with its per-reader cap of streams open already is refused (ResourceExhausted)."""
        streams = self.owner.streams
        n = streams.get(self.reader, 0)
        if n >= self.owner.reader_cap:
            raise ResourceExhausted(
                f"this reader has {n} Stage streams open on this owner already, its limit (the"
                f" per-reader cap: {self.owner.reader_cap} slots of this ring's"
                f" {self.owner.ring.info.chunks}, so a stream more could only wait)",
                field="open",
                fix=f"keep at most {self.owner.reader_cap} Stage streams open to this owner"
                " (half its advertised ring) and queue further pulls until one ends",
            )
        streams[self.reader] = n + 1
        try:
            await self._serve(returns, send)
        finally:
            if streams[self.reader] > 1:
                streams[self.reader] -= 1
            else:
                del streams[self.reader]

    async def _serve(self, returns: AsyncIterator[Sequence[int]], send: Send) -> None:
        work = asyncio.ensure_future(self._work(send))
        recv = asyncio.ensure_future(self._returns(returns))
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()

        def lease_gone() -> None:
            if not gone.done():
                gone.set_result(None)

        def ended(rel: Released) -> None:  # any thread: the request's lease ended
            if rel.request_id == self.request_id:
                loop.call_soon_threadsafe(lease_gone)

        self.owner.leases.subscribe(ended)
        stopped_at: tuple[int, int] | None = None
        why = "done"
        try:
            await asyncio.wait((work, recv, gone), return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                work.result()
            elif gone.done():  # the slots went back with the lease: no chunk starts any more
                stopped_at, why = (self.started, self.gathered), "lease ended"
                await self._stop(work)
                raise LeaseRefused(
                    f"the lease of {self.request_id!r} ended while its Stage stream was open",
                    field="open.request_id",
                    fix="hold the request again and pull it again",
                )
            else:
                stopped_at, why = (self.started, self.gathered), "reader closed"
                await self._stop(work)
                recv.result()  # a bad message fails the stream
        except asyncio.CancelledError:
            why = "cancelled"
            raise
        except BaseException as exc:
            why = why if why == "lease ended" else f"failed: {exc}"
            raise
        finally:
            self.owner.leases.unsubscribe(ended)
            gone.cancel()
            if stopped_at is None and not work.done():
                stopped_at = (self.started, self.gathered)
            for t in (work, recv):
                await self._stop(t)
            if self._early is not None:  # gathered as a credit arrived, never announced
                got, self._early = self._early, None
                await inline.discard(self.owner, got)
            self.owner.release(self.request_id, self.reader, sorted(self.out))
            self.out.clear()
            at = stopped_at or (self.started, self.gathered)
            log.info(
                "staged stream ended",
                extra=kv(
                    request_id=self.request_id,
                    reader=self.reader,
                    reason=why,
                    chunks=len(self.chunks),
                    started=self.started,
                    inline=self.inline,
                    gathered=self.gathered,
                    announced=self.announced,
                    returned=self.returned,
                    started_at_stop=at[0],
                    gathered_at_stop=at[1],
                ),
            )

    @staticmethod
    async def _stop(task: asyncio.Future[None]) -> None:
        """Cancel ``task`` and wait (boundedly) for it to end: a write to a call the reader
        already cancelled must not keep the stream from giving its slots back."""
        if not task.done():
            task.cancel()
        done, _ = await asyncio.wait({task}, timeout=STOP_WAIT_S)
        if not done:
            log.warning("a Stage stream task did not stop in time", extra=kv(wait_s=STOP_WAIT_S))
        elif not task.cancelled():
            task.exception()  # retrieved: the stream's outcome is decided by _serve

    async def _work(self, send: Send) -> None:
        for chunk in self.chunks:
            try:
                while self._early is None and self.credits <= 0:
                    self._idle = True  # _returns starts the next gather as the credit arrives
                    self._wake.clear()
                    await self._wake.wait()
            finally:
                self._idle = False  # stopped meanwhile: no chunk starts any more
            ready = self.ready_at
            if self._early is None:
                self._early = self._launch(chunk)
            if self._early is not None:
                got, self._early = self._early, None
                grant = await inline.land(self.owner, got)
            else:
                self.credits -= 1
                self.started += 1
                left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
                ids = self._ids(chunk)
                grant = await self.owner.fill(self.request_id, self.reader, ids, chunk.nbytes, left)
            self.gathered += 1
            self.out.add(grant.slot)
            start = max(0.0, grant.started_at - ready - grant.wait_s)
            await send(
                Announce(
                    chunk.index,
                    grant.slot,
                    grant.offset,
                    grant.nbytes,
                    grant.gather_s,
                    start,
                    grant.wait_s,
                )
            )
            self.announced += 1
            self.ready_at = time.monotonic()
        while self.out:  # every chunk announced: wait for the reader to return them
            self._wake.clear()
            await self._wake.wait()

    def _launch(self, chunk: Chunk) -> inline.Launched | None:
        """Gather ``chunk`` on the loop now, taking a credit, when it is small and a slot is
        free for this reader at once (:mod:`kvxferd.staging.inline`); else None."""
        got = inline.launch(
            self.owner, self.request_id, self.reader, self._ids(chunk), chunk.nbytes
        )
        if got is not None:
            self.credits -= 1
            self.started += 1
            self.inline += 1
        return got

    def _ids(self, chunk: Chunk) -> list[Int64Array]:
        part = list(self._none)
        for s in chunk.spans:
            part[s.group] = self.ids[s.group][s.start : s.stop]
        return part

    async def _returns(self, returns: AsyncIterator[Sequence[int]]) -> None:
        async for slots in returns:
            now = time.monotonic()
            blocked = self.credits <= 0  # the work waits for this credit from now on
            for slot in slots:
                if slot not in self.out:
                    raise InvalidRequest(
                        f"slot {slot} is not one of this stream's announced, unreturned slots"
                        f" ({sorted(self.out)})",
                        field="read_slots",
                        fix="return each announced slot once, after reading it",
                    )
                self.out.discard(slot)
                if self.owner.release(self.request_id, self.reader, [slot]) == 0:
                    raise LeaseRefused(
                        f"staging slot {slot} of {self.request_id!r} was taken back before it"
                        f" was returned (the lease ended, the reader was retired, or it was"
                        f" held past transfer.staging_grant_timeout_ms"
                        f" = {self.owner.grant_timeout_s * 1e3:.0f} ms)",
                        field="read_slots",
                        fix="return each slot as soon as its READ completes; retry the pull",
                    )
                self.returned += 1
                self.credits += 1
            if blocked and self.credits > 0:
                self.ready_at = now  # the next chunk could start only now
                if self._idle and self._early is None and self.started < len(self.chunks):
                    self._early = self._launch(self.chunks[self.started])  # no loop turn
            self._wake.set()


__all__ = ["Announce", "StageOpen", "StageStream"]
