"""Reader side of STAGED pulls: chunk by chunk, gather remotely, READ one slot, scatter.

An owner that serves ``Peer.Stage`` (its handshake's ring says ``stream``) is read over one
stream per pull, without a round trip per chunk (:mod:`kvxferd.staging.stage_reader`). An
older owner is read with one ``Peer.Gather`` per chunk, as follows. Per chunk: take a local
slot (awaiting one if the ring is busy), ask the owner to gather the chunk's remote kernel
blocks (``Peer.Gather``), READ the owner's slot into the local slot with one descriptor through
the :class:`~kvxferd.transfer.TransferEngine` (deadline, cancel and failure handling as for
DIRECT), hand the owner's slot back (piggybacked on the next Gather, or ``ReleaseStaging`` when
no Gather follows), scatter the local slot into the pool, free it. Chunks run concurrently up
to the ring's reader cap, so gathers, READs and scatters overlap. When every chunk is in place,
the transfer-done notification goes to the owner through the engine (as a DIRECT READ's
notification does), so the lease ends the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvxferd.blocks.ranges import RegionRanges, TransferPlan
from kvxferd.errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidRequest,
    KvxferdError,
    PeerUnavailable,
    TransportError,
)
from kvxferd.logs import kv
from kvxferd.staging.chunks import Chunk, RingInfo
from kvxferd.staging.device import Int64Array, PoolCopier
from kvxferd.staging.ring import StagingRing
from kvxferd.staging.slot_reads import SlotReads
from kvxferd.staging.stage_reader import StreamGates, StreamPull
from kvxferd.staging.stats import StageTimes
from kvxferd.transfer import TransferEngine, TransferResult, TransferStatus
from kvxferd.v1 import common_pb2, peer_pb2
from kvxferd.wire.peer_client import PeerClient

log = logging.getLogger(__name__)


@dataclass
class StagedJob:
    """One STAGED pull: paired kernel IDs per group, its chunks, where to read from."""

    transfer_id: str
    request_id: str
    reader_id: str
    peer_agent: str
    peer_address: str
    client: PeerClient  # the owner's Peer service (credentials and our session)
    remote_ring: RingInfo
    local_ids: tuple[Int64Array, ...]
    remote_ids: tuple[Int64Array, ...]
    chunks: Sequence[Chunk]
    deadline: float  # monotonic
    notif: bytes
    times: StageTimes = field(default_factory=StageTimes)
    owner_free: list[int] = field(default_factory=list)  # read, not yet given back
    owner_held: set[int] = field(default_factory=set)  # granted to us, not yet given back
    gathers_left: int = 0

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


class StagedReader:
    """Runs STAGED pulls over ``ring`` into ``copier``'s pool."""

    def __init__(
        self,
        ring: StagingRing,
        copier: PoolCopier,
        engine: TransferEngine,
        *,
        staging_region: int,
    ) -> None:
        self.ring = ring
        self.copier = copier
        self.engine = engine
        self.staging_region = staging_region
        self.reads = SlotReads(engine, staging_region)  # Stage streams' READs, kept across pulls
        self.gates = StreamGates()
        self._running: dict[str, asyncio.Task[None]] = {}
        self._cancelled: set[str] = set()

    def cancel(self, transfer_id: str) -> bool:
        """Cancel a running STAGED pull; False if there is none with that ID."""
        task = self._running.get(transfer_id)
        if task is None or task.done():
            return False
        self._cancelled.add(transfer_id)
        task.cancel()
        return True

    async def pull(
        self, job: StagedJob, local_blocks: tuple[Int64Array, ...], nbytes: int
    ) -> TransferResult:
        """Run ``job`` to a terminal :class:`TransferResult` (the DIRECT result's shape)."""
        tid = job.transfer_id
        t0 = time.monotonic()
        job.times.chunks = len(job.chunks)
        job.gathers_left = len(job.chunks)
        driver = asyncio.get_running_loop().create_task(self._drive(job))
        self._running[tid] = driver
        status: TransferStatus = TransferStatus.DONE
        err: KvxferdError | None = None
        try:
            await asyncio.wait_for(asyncio.shield(driver), timeout=max(1e-3, job.remaining()))
        except TimeoutError:
            status = TransferStatus.EXPIRED
            err = DeadlineExceeded(
                f"staged pull of {len(job.chunks)} chunks outlasted its deadline",
                fix="raise deadline_ms, or check the peer's health and staging ring",
            )
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if tid not in self._cancelled or (current is not None and current.cancelling()):
                await self._stop(driver)
                raise
            status, err = TransferStatus.CANCELLED, Cancelled(f"transfer {tid} cancelled")
        except KvxferdError as exc:
            status, err = TransferStatus.FAILED, exc
        except Exception as exc:  # a bug or a torch/CUDA error: still a terminal status
            log.exception("staged pull failed", extra=kv(transfer_id=tid))
            status = TransferStatus.FAILED
            err = TransportError(
                f"staged pull failed: {type(exc).__name__}: {exc}",
                fix="see the daemon log; retry with transfer.strategy = direct",
            )
        finally:
            await self._stop(driver)
            self._running.pop(tid, None)
            self._cancelled.discard(tid)
            await self._give_back(job)
        return TransferResult(
            tid,
            job.peer_agent,
            status,
            reason=str(err) if err else "",
            error=err,
            invalid_blocks=() if status is TransferStatus.DONE else local_blocks,
            nbytes=nbytes,
            descriptors=len(job.chunks),
            elapsed_s=time.monotonic() - t0,
        )

    async def _stop(self, driver: asyncio.Task[None]) -> None:
        if not driver.done():
            driver.cancel()
        await asyncio.gather(driver, return_exceptions=True)

    async def _drive(self, job: StagedJob) -> None:
        if job.remote_ring.stream and job.client.can_stream:  # one Stage stream for the pull
            async with self.gates.turn(job):  # at most the owner's cap of streams to it
                await StreamPull(job, self.ring, self.copier, self.engine, self.reads).run()
        else:  # an owner without Stage: one Gather per chunk
            await self._drive_gathers(job)
        if job.notif:
            done_xfer = self.engine.submit(
                f"{job.transfer_id}#done",
                job.peer_agent,
                TransferPlan(ranges=()),
                notif=job.notif,
                timeout_s=max(1e-3, job.remaining()),
            )
            await done_xfer.wait()

    async def _drive_gathers(self, job: StagedJob) -> None:
        tasks = [asyncio.ensure_future(self._chunk(job, c)) for c in job.chunks]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                exc = t.exception()
                if exc is not None:
                    raise exc
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._give_back(job)

    async def _chunk(self, job: StagedJob, chunk: Chunk) -> None:
        t0 = time.monotonic()
        async with self.ring.reader_slot() as slot:
            t1 = time.monotonic()
            job.times.slot_wait_s += t1 - t0
            remote_ids, local_ids = self._ids(job, chunk)
            grant = await self._gather(job, chunk, remote_ids)
            t2 = time.monotonic()
            job.times.gather_rpc_s += t2 - t1
            job.times.gather_s += grant.gather_us / 1e6
            try:
                await self._read(job, chunk, slot, grant)
            finally:
                job.owner_held.discard(grant.slot)
                job.owner_free.append(grant.slot)
                if job.gathers_left == 0:
                    # No later Gather will carry the release: give back what was read, never
                    # a slot another chunk of this pull is still reading.
                    await self._give_back(job, read_only=True)
            t3 = time.monotonic()
            job.times.read_s += t3 - t2
            view = self.ring.view(slot, chunk.nbytes)
            work = asyncio.ensure_future(asyncio.to_thread(self.copier.scatter, local_ids, view))
            try:
                await asyncio.shield(work)
            except asyncio.CancelledError:
                await asyncio.gather(work, return_exceptions=True)  # never free a busy slot
                raise
            job.times.scatter_s += time.monotonic() - t3

    def _ids(self, job: StagedJob, chunk: Chunk) -> tuple[list[Int64Array], list[Int64Array]]:
        empty = np.zeros(0, dtype=np.int64)
        remote = [empty] * len(job.remote_ids)
        local = [empty] * len(job.local_ids)
        for s in chunk.spans:
            remote[s.group] = job.remote_ids[s.group][s.start : s.stop]
            local[s.group] = job.local_ids[s.group][s.start : s.stop]
        return remote, local

    async def _gather(
        self, job: StagedJob, chunk: Chunk, remote_ids: list[Int64Array]
    ) -> peer_pb2.GatherResponse:
        release, job.owner_free = job.owner_free, []
        job.gathers_left -= 1
        try:
            resp = await job.client.gather(
                peer_pb2.GatherRequest(
                    request_id=job.request_id,
                    reader_id=job.reader_id,
                    kernel_block_ids=common_pb2.GroupBlockIds(
                        groups=[common_pb2.BlockIds(ids=a.tolist()) for a in remote_ids]
                    ),
                    release_slots=release,
                ),
                f"staging gather of chunk {chunk.index}",
                job.remaining(),
            )
        except KvxferdError:
            job.owner_free.extend(release)  # unknown whether they were freed: try again later
            raise
        job.owner_held.add(resp.slot)
        ring = job.remote_ring
        if (
            resp.nbytes != chunk.nbytes
            or resp.slot >= ring.chunks
            or resp.offset != resp.slot * ring.chunk_bytes
        ):
            raise InvalidRequest(
                f"peer {job.peer_address} answered slot {resp.slot} offset {resp.offset}"
                f" with {resp.nbytes} bytes for a {chunk.nbytes}-byte chunk",
                fix="the peers disagree on the staging layout: run the same kvxferd version",
            )
        return resp

    async def _read(
        self, job: StagedJob, chunk: Chunk, slot: int, grant: peer_pb2.GatherResponse
    ) -> None:
        one = np.array([chunk.nbytes], dtype=np.int64)
        plan = TransferPlan(
            ranges=(
                RegionRanges(
                    self.staging_region,
                    "staging",
                    np.array([self.ring.info.slot_offset(slot)], dtype=np.int64),
                    np.array([grant.offset], dtype=np.int64),
                    one,
                ),
            )
        )
        xid = f"{job.transfer_id}#{chunk.index}"
        xfer = self.engine.submit(xid, job.peer_agent, plan, timeout_s=max(1e-3, job.remaining()))
        try:
            result = await asyncio.shield(asyncio.wrap_future(xfer.future))
        except asyncio.CancelledError:
            # Release the NIXL handle before the local slot can be reused.
            await asyncio.wrap_future(self.engine.cancel(xid))
            raise
        if result.status is not TransferStatus.DONE:
            raise result.error or PeerUnavailable(
                f"reading staging chunk {chunk.index}: {result.reason}"
            )

    async def _give_back(self, job: StagedJob, *, read_only: bool = False) -> None:
        """Release our owner slots: those read (``read_only``), or all of them once no chunk
        of the pull can still be reading (the pull ended)."""
        slots = sorted(set(job.owner_free) if read_only else set(job.owner_free) | job.owner_held)
        if not slots:
            return
        job.owner_free = []
        if not read_only:
            job.owner_held.clear()
        try:
            await job.client.release_staging(
                peer_pb2.ReleaseStagingRequest(
                    request_id=job.request_id, reader_id=job.reader_id, slots=slots
                )
            )
        except KvxferdError as err:
            # The owner takes the slots back when the lease ends or the grant times out.
            log.warning(
                "staging release failed",
                extra=kv(peer=job.peer_address, slots=slots, error=str(err)),
            )
