"""Reader side of a STAGED pull over one ``Peer.Stage`` stream (no round trip per chunk).

The pull takes up to ``credits`` local slots (the smaller of this ring's reader cap, the owner's
per-reader cap and the chunk count; the first awaited, the rest only if free now), opens one
stream naming the request, every remote kernel block ID and the chunking, and grants that many
credits. The owner gathers chunk after chunk and announces each; on each announcement the
reader posts the chunk's one-descriptor READ at once into a free local slot (prepared once per
slot pair: :mod:`kvxferd.staging.slot_reads`). When a READ completes, its owner slot goes back
on the stream (a credit back), and the local slot is scattered into the pool and freed.
Anything failing, a cancel or the deadline cancels the stream (the owner stops after the chunk
in progress) and every READ still in flight. At most the owner's per-reader cap of streams is
open to one owner at once (:class:`StreamGates`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import numpy as np

from kvxferd.errors import InvalidRequest, PeerUnavailable
from kvxferd.staging.chunks import Chunk
from kvxferd.staging.device import PoolCopier
from kvxferd.staging.ring import StagingRing, half_cap
from kvxferd.staging.slot_reads import SlotReads
from kvxferd.transfer import Transfer, TransferEngine, TransferStatus
from kvxferd.v1 import common_pb2, peer_pb2
from kvxferd.wire.peer_client import StageCall

if TYPE_CHECKING:
    from kvxferd.staging.reader import StagedJob

# The open, then owner slots read (credits back, batched into one message while the previous
# one is being sent), then None (half-close).
Requests = asyncio.Queue[peer_pb2.StageRequest | int | None]


class StreamGates:
    """At most the owner's per-reader cap of Stage streams open to one owner at once: the owner
    refuses more (RESOURCE_EXHAUSTED), and a stream more could only wait for its slots there.
    A pull beyond it waits here, before it takes local slots, until a stream to that owner
    ends (counted as ``slot_wait``). Per owner (agent name and cap); an entry lives while a
    pull uses or awaits it."""

    def __init__(self) -> None:
        self._gates: dict[tuple[str, int], tuple[asyncio.Semaphore, list[int]]] = {}

    @asynccontextmanager
    async def turn(self, job: StagedJob) -> AsyncIterator[None]:
        key = (job.peer_agent, half_cap(job.remote_ring.chunks))
        sem, users = self._gates.setdefault(key, (asyncio.Semaphore(key[1]), [0]))
        users[0] += 1
        try:
            t0 = time.monotonic()
            async with sem:
                job.times.slot_wait_s += time.monotonic() - t0
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._gates[key]


class StreamPull:
    """One STAGED pull of ``job`` over a Stage stream, into ``ring`` and ``copier``'s pool."""

    def __init__(
        self,
        job: StagedJob,
        ring: StagingRing,
        copier: PoolCopier,
        engine: TransferEngine,
        reads: SlotReads,
    ) -> None:
        self.job = job
        self.ring = ring
        self.copier = copier
        self.engine = engine
        self.reads = reads
        self.free: deque[int] = deque()  # local slots not reading or scattering
        self.freed = asyncio.Event()
        self.credit_at: list[float] = []  # when credit i was given (chunk i may start)
        self.owner_out: set[int] = set()  # owner slots announced, not yet returned
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def run(self) -> None:
        job = self.job
        job.times.stream = True
        want = min(self.ring.reader_cap, half_cap(job.remote_ring.chunks), len(job.chunks))
        t0 = time.monotonic()
        async with self.ring.reader_slots(want) as slots:
            job.times.slot_wait_s += time.monotonic() - t0
            self.free.extend(slots)
            await self._stream(len(slots))

    async def _stream(self, credits: int) -> None:
        job = self.job
        queue: Requests = asyncio.Queue()

        async def requests() -> AsyncIterator[peer_pb2.StageRequest]:
            while (item := await queue.get()) is not None:
                if not isinstance(item, int):
                    yield item  # the open
                    continue
                slots, end = [item], False  # credits back: those queued meanwhile go along
                while not end and not queue.empty():
                    more = queue.get_nowait()
                    end = more is None
                    if isinstance(more, int):
                        slots.append(more)
                yield peer_pb2.StageRequest(read_slots=slots)
                if end:
                    return

        slot_bytes = min(self.ring.info.chunk_bytes, job.remote_ring.chunk_bytes)
        groups = [common_pb2.BlockIds(ids=a.tolist()) for a in job.remote_ids]
        queue.put_nowait(
            peer_pb2.StageRequest(
                open=peer_pb2.StageOpen(
                    request_id=job.request_id,
                    reader_id=job.reader_id,
                    kernel_block_ids=common_pb2.GroupBlockIds(groups=groups),
                    chunk_bytes=slot_bytes,
                    chunks=len(job.chunks),
                    credits=credits,
                )
            )
        )
        call = job.client.stage(requests(), max(1e-3, job.remaining()))
        self.credit_at = [time.monotonic()] * credits
        tasks: list[asyncio.Task[None]] = []
        recv = asyncio.ensure_future(self._announcements(call, queue, tasks))
        try:
            await asyncio.wait((recv, self.failed), return_when=asyncio.FIRST_COMPLETED)
            if self.failed.done():
                self.failed.result()
            recv.result()
            for t in tasks:  # every READ posted; the first failure, if any, is raised
                await t
        finally:
            queue.put_nowait(None)
            call.cancel()  # a no-op once the owner ended it; else the owner stops
            recv.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(recv, *tasks, return_exceptions=True)
            if self.failed.done() and not self.failed.cancelled():
                self.failed.exception()  # retrieved: raised above when it came first

    async def _announcements(
        self, call: StageCall, queue: Requests, tasks: list[asyncio.Task[None]]
    ) -> None:
        job = self.job
        n = 0
        last = 0.0
        async for ev in job.client.events(call, "the staging stream"):
            arrived = time.monotonic()
            chunk = self._check(ev, n)
            waited = 0.0
            if not self.free:
                while not self.free:
                    self.freed.clear()
                    await self.freed.wait()
                waited = time.monotonic() - arrived
            local = self.free.popleft()
            xfer = self._post(chunk, local, ev)  # the READ first, the bookkeeping after
            posted = time.monotonic()
            t = job.times
            t.control_s += posted - arrived - waited
            t.slot_wait_s += waited
            t.gather_s += ev.gather_us / 1e6
            t.owner_start_s += ev.start_us / 1e6
            t.owner_slot_wait_s += ev.slot_wait_us / 1e6
            t.gather_rpc_s += arrived - max(self.credit_at[n], last)
            last = arrived
            tasks.append(
                asyncio.ensure_future(
                    self._finish(chunk, local=local, ev=ev, xfer=xfer, posted=posted, queue=queue)
                )
            )
            n += 1
        if n != len(job.chunks):
            raise PeerUnavailable(
                f"peer {job.peer_address} ended the staging stream after {n} of"
                f" {len(job.chunks)} chunks",
                fix="see the peer's log ('staged stream ended'); retry the pull",
            )

    def _check(self, ev: peer_pb2.StageResponse, n: int) -> Chunk:
        job, ring = self.job, self.job.remote_ring
        chunk = job.chunks[n] if n < len(job.chunks) else None
        if (
            chunk is None
            or ev.chunk != n
            or ev.nbytes != chunk.nbytes
            or ev.slot >= ring.chunks
            or ev.offset != ev.slot * ring.chunk_bytes
            or ev.slot in self.owner_out
        ):
            raise InvalidRequest(
                f"peer {job.peer_address} announced chunk {ev.chunk} in slot {ev.slot} offset"
                f" {ev.offset} with {ev.nbytes} bytes, expected chunk {n} of"
                f" {len(job.chunks)} in a free slot of its {ring.chunks}",
                fix="the peers disagree on the staging layout: run the same kvxferd version",
            )
        self.owner_out.add(ev.slot)
        return chunk

    def _post(self, chunk: Chunk, local: int, ev: peer_pb2.StageResponse) -> Transfer:
        job = self.job
        return self.reads.post(
            f"{job.transfer_id}#{chunk.index}",
            job.peer_agent,
            local * self.ring.info.chunk_bytes,  # a free local slot: inside the ring
            ev.offset,  # checked: a slot of the owner's ring
            chunk.nbytes,  # checked: fits both slots
            timeout_s=max(1e-3, job.deadline - time.monotonic()),
        )

    async def _finish(
        self,
        chunk: Chunk,
        *,
        local: int,
        ev: peer_pb2.StageResponse,
        xfer: Transfer,
        posted: float,
        queue: Requests,
    ) -> None:
        job = self.job
        try:
            try:
                result = await asyncio.shield(asyncio.wrap_future(xfer.future))
            except asyncio.CancelledError:
                # Release the NIXL handle before the local slot can be reused.
                await asyncio.wrap_future(self.engine.cancel(xfer.transfer_id))
                raise
            read = time.monotonic()
            job.times.read_s += read - posted
            if result.status is not TransferStatus.DONE:
                raise result.error or PeerUnavailable(
                    f"reading staging chunk {chunk.index}: {result.reason}"
                )
            self.owner_out.discard(ev.slot)
            queue.put_nowait(ev.slot)  # a credit back
            self.credit_at.append(time.monotonic())
            await self._scatter(chunk, local)
            job.times.scatter_s += time.monotonic() - read
        except BaseException as exc:
            if not self.failed.done() and not isinstance(exc, asyncio.CancelledError):
                self.failed.set_exception(exc)
            raise
        finally:
            self.free.append(local)
            self.freed.set()

    async def _scatter(self, chunk: Chunk, local: int) -> None:
        job = self.job
        empty = np.zeros(0, dtype=np.int64)
        ids = [empty] * len(job.local_ids)
        for s in chunk.spans:
            ids[s.group] = job.local_ids[s.group][s.start : s.stop]
        view = self.ring.view(local, chunk.nbytes)
        work = asyncio.ensure_future(asyncio.to_thread(self.copier.scatter, ids, view))
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            await asyncio.gather(work, return_exceptions=True)  # never free a busy slot
            raise


__all__ = ["StreamGates", "StreamPull"]
