"""The daemon's operations, independent of gRPC: hold, handshake, pull, watch, checksum.

:class:`Daemon` takes its parts (pool, NIXL agent, transfer engine, lease table, peer
directory) and starts nothing; ``kvxferd.service.app`` wires and starts them. Servicers are
thin: they decode a request, call one method here and encode the answer. Every method runs on
the event loop; NIXL work happens on the agent's thread through the transfer engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from grpc import aio

from kvxferd.blocks import check_block_ids, expand_group, plan_pull
from kvxferd.blocks.ranges import TransferPlan
from kvxferd.daemon.peers import (
    LinkState,
    PeerDirectory,
    PeerLink,
    RemoteDescription,
    SelfDescription,
    remote_error,
)
from kvxferd.daemon.pulls import PullBook, PullRecord, PullState
from kvxferd.daemon.slot import PoolSlot
from kvxferd.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    InvalidRequest,
    KvxferdError,
    LeaseRefused,
    NotFound,
    PeerUnavailable,
    ResourceExhausted,
)
from kvxferd.layout.spec import MemoryType
from kvxferd.logs import kv
from kvxferd.metrics import Metrics
from kvxferd.nixl import MemType
from kvxferd.peers import PeerInfo
from kvxferd.pool import KVPool
from kvxferd.staging.reader import StagedJob
from kvxferd.staging.setup import Decision, Staging, StagingFactory, decide
from kvxferd.transfer import (
    LeaseTable,
    ReleaseFeed,
    ReleaseReason,
    TransferEngine,
    TransferResult,
    TransferStatus,
    notify,
)
from kvxferd.transfer.leases import Lease
from kvxferd.transfer.strategy import Strategy
from kvxferd.v1 import peer_pb2, spec_pb2

log = logging.getLogger(__name__)

Int64Array = npt.NDArray[np.int64]

_TERMINAL = {
    TransferStatus.DONE: PullState.DONE,
    TransferStatus.FAILED: PullState.FAILED,
    TransferStatus.CANCELLED: PullState.CANCELLED,
    TransferStatus.EXPIRED: PullState.EXPIRED,
}


@dataclass(frozen=True)
class DaemonLimits:
    default_deadline_s: float = 30.0
    max_inflight: int = 256
    lease_ttl_s: float = 60.0
    max_block_ids: int = 1 << 20
    peer_timeout_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0


@dataclass(frozen=True)
class PullRequest:
    """A scheduler's StartPull, decoded. Block IDs are logical, one array per KV group."""

    transfer_id: str
    request_id: str
    peer_address: str
    remote_ids: tuple[Int64Array, ...]
    local_ids: tuple[Int64Array, ...]
    deadline_s: float
    notify: bool = True


@dataclass(frozen=True)
class Release:
    """A held request the engine may now free: the logical IDs it held, and why."""

    request_id: str
    reason: ReleaseReason
    logical_ids: tuple[Int64Array, ...]


@dataclass(frozen=True)
class HeldRequest:
    request_id: str
    logical_ids: tuple[Int64Array, ...]
    lease: Lease


class Daemon:
    """One kvxferd daemon: the owner side (hold, leases) and the reader side (pull)."""

    def __init__(
        self,
        *,
        pool: KVPool | PoolSlot,
        info: PeerInfo | None,
        engine: TransferEngine,
        leases: LeaseTable,
        agent_name: str,
        agent_metadata: bytes,
        address: str,
        metrics: Metrics,
        limits: DaemonLimits,
        instance_id: str | None = None,
        call_metadata: tuple[tuple[str, str], ...] = (),
        staging: StagingFactory | None = None,
    ) -> None:
        if isinstance(pool, KVPool):
            if info is None:
                raise InvalidRequest("an owned pool needs its PeerInfo", field="info")
            pool = PoolSlot.owned(pool, info, agent_metadata)
        self.slot = pool
        self.engine = engine
        self.leases = leases
        self.agent_name = agent_name
        self.address = address
        self.metrics = metrics
        self.limits = limits
        self.call_metadata = call_metadata
        self._staging_factory = staging
        self.staging: Staging | None = None
        if staging is not None:
            self.staging = staging.build(pool.current() if pool.registered else None)
        self.instance_id = instance_id or uuid.uuid4().hex
        self.daemon_id = agent_name
        self.pulls = PullBook()
        self.peers: PeerDirectory | None = None
        self.draining = False
        self._held: dict[str, HeldRequest] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._release_watchers: list[tuple[frozenset[str], asyncio.Queue[Release]]] = []

    # -- the pool (fixed, or attached by an engine: kvxferd.daemon.slot) ---------------------

    @property
    def pool(self) -> KVPool:
        """The registered pool; raises EngineDetached while an attached daemon has none."""
        return self.slot.current()

    @property
    def info(self) -> PeerInfo:
        return self.slot.served().info

    @property
    def agent_metadata(self) -> bytes:
        return self.slot.metadata

    @property
    def generation(self) -> int:
        return self.slot.generation

    def local_rows(self, pool_rows: Int64Array) -> Int64Array:
        """The transfer engine's local regions for a pool: its rows, then the staging ring's."""
        f = self._staging_factory
        return pool_rows if f is None else f.local_rows(pool_rows)

    def rebind_staging(self, pool: KVPool | None) -> None:
        """An engine attached ``pool`` (or detached: None): staging follows the pool."""
        if self._staging_factory is None:
            return
        if self.staging is not None and self.staging.owner is not None:
            self.staging.owner.stop()
        self.staging = self._staging_factory.build(pool)

    # -- wiring -------------------------------------------------------------------------------

    def attach_peers(self, peers: PeerDirectory) -> None:
        self.peers = peers

    def observe_peer(self, link: PeerLink) -> None:
        """Metrics after a handshake attempt (PeerDirectory's callback)."""
        result = {LinkState.READY: "ok", LinkState.REFUSED: "refused"}.get(link.state, "failed")
        self.metrics.handshakes.labels("client", result).inc()
        self._peer_gauge()

    def _peer_gauge(self) -> None:
        if self.peers is not None:
            links = self.peers.links()
            for state in LinkState:
                n = sum(1 for x in links if x.state is state)
                self.metrics.peers.labels(state.value).set(n)

    def describe_self(self) -> SelfDescription:
        served = self.slot.served()
        regs = tuple(
            spec_pb2.RegionRegistration(
                region_name=r.name, base_address=m.addr, device_id=m.device, nbytes=m.nbytes
            )
            for r, m in zip(served.pool.spec.regions, served.pool.memory, strict=True)
        )
        return SelfDescription(
            info=served.info,
            agent_name=self.agent_name,
            agent_metadata=self.agent_metadata,
            registrations=regs,
            generation=self.generation,
            daemon_id=self.daemon_id,
            instance_id=self.instance_id,
            address=self.address,
            staging=self.staging.info if self.staging else None,
        )

    def connect_remote(self, remote: RemoteDescription) -> None:
        """Load a handshaken peer's NIXL metadata and regions (once per peer incarnation)."""
        mem = _mem_type(remote)
        regions = remote.regions
        if remote.staging is not None and self.staging and self.staging.info is not None:
            # The peer's ring is one more region, at the index our own ring has locally.
            regions = np.vstack([regions, np.array([remote.staging.row()], dtype=np.int64)])
        self.engine.connect_peer(remote.agent_name, remote.agent_metadata, regions, mem)

    async def start_release_pump(self) -> None:
        """Forward lease releases (from any thread) to engine watchers on this loop."""
        feed = ReleaseFeed(asyncio.get_running_loop())
        self.leases.subscribe(feed)
        self._spawn(self._pump_releases(feed))

    async def _pump_releases(self, feed: ReleaseFeed) -> None:
        async for rel in feed:
            held = self._held.pop(rel.request_id, None)
            if held is None:
                continue  # not held through this daemon (cannot happen; be safe)
            release = Release(rel.request_id, rel.reason, held.logical_ids)
            self.metrics.lease_releases.labels(rel.reason.value).inc()
            self.metrics.leases_active.set(len(self.leases))
            log.info(
                "lease released",
                extra=kv(request_id=rel.request_id, reason=rel.reason.value, readers=rel.readers),
            )
            for ids, q in self._release_watchers:
                if not ids or rel.request_id in ids:
                    q.put_nowait(release)

    # -- owner side (prefill) ---------------------------------------------------------------

    def hold(
        self,
        request_id: str,
        logical_ids: Sequence[Sequence[int] | Int64Array],
        readers: int,
        ttl_s: float | None,
    ) -> HeldRequest:
        spec = self.pool.spec
        if len(logical_ids) != len(spec.groups):
            raise InvalidRequest(
                f"{len(logical_ids)} block-ID lists for {len(spec.groups)} KV cache groups",
                field="block_ids.groups",
                fix=f"send one list per group, in order: {[g.name for g in spec.groups]}",
            )
        checked: list[Int64Array] = []
        kernel: list[Int64Array] = []
        for g, ids in enumerate(logical_ids):
            group = spec.groups[g]
            limit = spec.num_kernel_blocks(g) if group.kind.is_state else spec.num_logical_blocks(g)
            arr = check_block_ids(
                ids, limit, f"block_ids.groups[{g}].ids", max_ids=self.limits.max_block_ids
            )
            checked.append(arr)
            kernel.append(expand_group(group, arr))
        lease = self.leases.hold(
            request_id, kernel, readers=max(1, readers), ttl_s=ttl_s or self.limits.lease_ttl_s
        )
        held = HeldRequest(request_id, tuple(checked), lease)
        self._held[request_id] = held
        self.metrics.leases_active.set(len(self.leases))
        log.info(
            "request held",
            extra=kv(request_id=request_id, blocks=[int(a.size) for a in checked], readers=readers),
        )
        return held

    def held(self, request_id: str) -> HeldRequest:
        h = self._held.get(request_id)
        if h is None:
            raise LeaseRefused(
                f"request {request_id!r} is not held here (never held, released or expired)",
                field="request_id",
                fix="the prefill engine must Hold the request before the decode side pulls it",
            )
        return h

    def confirm_lease(self, request_id: str, extend_s: float | None) -> HeldRequest:
        self.slot.current()  # EngineDetached: say why, rather than "not held"
        h = self.held(request_id)
        lease = self.leases.confirm_and_extend(request_id, extend_s or None)
        return HeldRequest(h.request_id, h.logical_ids, lease)

    def held_request_ids(self) -> list[str]:
        return list(self._held)

    def watch_releases(self, request_ids: frozenset[str]) -> asyncio.Queue[Release]:
        q: asyncio.Queue[Release] = asyncio.Queue()
        self._release_watchers.append((request_ids, q))
        return q

    def unwatch_releases(self, q: asyncio.Queue[Release]) -> None:
        self._release_watchers = [(i, w) for i, w in self._release_watchers if w is not q]

    # -- reader side (decode) ---------------------------------------------------------------

    async def start_pull(self, req: PullRequest) -> PullRecord:
        """Validate, handshake (cached), plan, then run the pull in the background.

        Errors a caller can fix (bad IDs, incompatible or unreachable peer, full queue) are
        raised here, before a transfer exists; later failures end in the pull's status.
        """
        if self.draining:
            raise PeerUnavailable(
                "this daemon is shutting down and takes no new pulls",
                fix="send the pull to another decode daemon",
            )
        if not req.request_id:
            raise InvalidRequest("request_id is empty", field="request_id")
        if not req.peer_address:
            raise InvalidRequest(
                "peer_address is empty", field="peer_address", fix="pass HoldResponse.peer_address"
            )
        if req.deadline_s <= 0:
            raise InvalidRequest(f"deadline {req.deadline_s}s is not positive", field="deadline_ms")
        if req.transfer_id in self.pulls:
            raise AlreadyExists(
                f"transfer {req.transfer_id!r} already exists",
                field="transfer_id",
                fix="use a new transfer_id, or leave it empty to get a generated one",
            )
        if self.pulls.num_active >= self.limits.max_inflight:
            raise ResourceExhausted(
                f"{self.limits.max_inflight} pulls are already in flight",
                fix="retry later or raise transfer.max_inflight",
            )
        assert self.peers is not None, "attach_peers() before start_pull()"
        link = await self.peers.ready(req.peer_address)
        remote = link.remote
        assert remote is not None
        plan = plan_pull(
            self.pool.spec,
            remote.info.spec,
            list(req.local_ids),
            list(req.remote_ids),
            prefix_caching=self.info.prefix_caching,
            local_tp=(self.info.tp_rank, self.info.tp_size),
            remote_tp=(remote.info.tp_rank, remote.info.tp_size),
            max_ids=self.limits.max_block_ids,
        )
        part = plan.per_rank.get(remote.info.tp_rank) or TransferPlan(ranges=())
        decision = None
        if self.staging is not None:
            decision = decide(
                self.staging,
                local=self.pool.spec,
                remote=remote.info.spec,
                local_tp_size=self.info.tp_size,
                remote_tp_size=remote.info.tp_size,
                remote_ring=remote.staging,
                plan=plan,
                part=part,
                peer=req.peer_address,
            )
            log.info(
                "pull strategy",
                extra=kv(
                    transfer_id=req.transfer_id,
                    strategy=decision.choice.strategy.value,
                    reason=decision.choice.reason,
                    chunks=len(decision.chunks),
                ),
            )
        rec = self.pulls.add(
            PullRecord(
                transfer_id=req.transfer_id,
                request_id=req.request_id,
                peer_address=req.peer_address,
                nbytes=part.nbytes,
                naive_descriptors=part.naive_descriptors,
                deadline_ns=time.time_ns() + int(req.deadline_s * 1e9),
                strategy=decision.choice.strategy.value if decision else "DIRECT",
                strategy_reason=decision.choice.reason if decision else "staging not configured",
            )
        )
        self.metrics.inflight_transfers.inc()
        staged = decision if decision and decision.choice.strategy is Strategy.STAGED else None
        self._spawn(
            self._run_pull(
                req,
                link,
                part,
                plan.local_kernel_blocks,
                staged=staged,
                remote_blocks=plan.remote_kernel_blocks,
            )
        )
        return rec

    async def _run_pull(
        self,
        req: PullRequest,
        link: PeerLink,
        plan: TransferPlan,
        local_blocks: tuple[Int64Array, ...],
        *,
        staged: Decision | None = None,
        remote_blocks: tuple[Int64Array, ...] = (),
    ) -> None:
        tid = req.transfer_id
        t0 = time.monotonic()
        deadline = t0 + req.deadline_s
        remote = link.remote
        assert remote is not None
        try:
            self.pulls.update(tid, state=PullState.CONFIRMING, started_ns=time.time_ns())
            await asyncio.wait_for(
                self._confirm(link, req), timeout=max(1e-3, deadline - time.monotonic())
            )
            if self.pulls.get(tid).state.terminal:
                return  # cancelled while confirming: nothing was posted, nothing written
            self.pulls.update(tid, state=PullState.TRANSFERRING)
            note = notify.encode(req.request_id) if req.notify else b""
            if staged is not None:
                job = self._staged_job(
                    req,
                    link,
                    staged,
                    local_blocks=local_blocks,
                    remote_blocks=remote_blocks,
                    deadline=deadline,
                )
                result = await self._staged_pull(job, plan)
            else:
                xfer = self.engine.submit(
                    tid,
                    remote.agent_name,
                    plan,
                    notif=note,
                    timeout_s=max(1e-3, deadline - time.monotonic()),
                )
                result = await xfer.wait()
            state = _TERMINAL[result.status]
            self.pulls.update(
                tid,
                state=state,
                posted_descriptors=result.descriptors,
                error=result.error
                or (None if state is PullState.DONE else KvxferdError(result.reason)),
                invalid_local_blocks=result.invalid_blocks,
            )
            if isinstance(result.error, PeerUnavailable) and self.peers is not None:
                await self.peers.invalidate(req.peer_address, str(result.error))
                self._peer_gauge()
        except TimeoutError:
            self.pulls.update(
                tid,
                state=PullState.EXPIRED,
                error=DeadlineExceeded(
                    f"confirming the lease with {req.peer_address} outlasted the deadline",
                    fix="raise deadline_ms or check the peer's health",
                ),
                invalid_local_blocks=local_blocks,
            )
        except KvxferdError as err:
            if isinstance(err, PeerUnavailable) and self.peers is not None:
                await self.peers.invalidate(req.peer_address, str(err))
                self._peer_gauge()
            self.pulls.update(
                tid, state=PullState.FAILED, error=err, invalid_local_blocks=local_blocks
            )
        except asyncio.CancelledError:
            self.pulls.update(
                tid,
                state=PullState.CANCELLED,
                error=Cancelled("the daemon stopped before the pull finished"),
                invalid_local_blocks=local_blocks,
            )
            raise
        finally:
            rec = self.pulls.get(tid)
            self._account(rec, time.monotonic() - t0)

    def _staged_job(
        self,
        req: PullRequest,
        link: PeerLink,
        staged: Decision,
        *,
        local_blocks: tuple[Int64Array, ...],
        remote_blocks: tuple[Int64Array, ...],
        deadline: float,
    ) -> StagedJob:
        assert link.remote is not None and link.remote.staging is not None
        return StagedJob(
            transfer_id=req.transfer_id,
            request_id=req.request_id,
            reader_id=self.agent_name,
            peer_agent=link.remote.agent_name,
            peer_address=req.peer_address,
            stub=link.stub,
            remote_ring=link.remote.staging,
            local_ids=local_blocks,
            remote_ids=remote_blocks,
            chunks=staged.chunks,
            deadline=deadline,
            notif=notify.encode(req.request_id) if req.notify else b"",
        )

    async def _staged_pull(self, job: StagedJob, plan: TransferPlan) -> TransferResult:
        assert self.staging is not None and self.staging.reader is not None
        try:
            return await self.staging.reader.pull(job, plan.local_kernel_blocks, plan.nbytes)
        finally:
            self.pulls.update(job.transfer_id, stage_times=job.times)

    async def _confirm(self, link: PeerLink, req: PullRequest) -> None:
        assert link.remote is not None
        try:
            resp = await link.stub.ConfirmLease(
                peer_pb2.ConfirmLeaseRequest(
                    request_id=req.request_id,
                    reader_id=self.agent_name,
                    extend_ms=int(max(1.0, req.deadline_s) * 1000),
                ),
                timeout=self.limits.peer_timeout_s,
                metadata=self.call_metadata,
            )
        except aio.AioRpcError as exc:
            raise remote_error(
                exc, f"confirming the lease of {req.request_id!r}", link.address
            ) from exc
        if self.peers is not None:
            # The owner re-registered (its engine re-attached): its regions moved.
            await self.peers.refresh(link, resp.lease.registration_generation)
        held = resp.lease.block_ids.groups
        for g, ids in enumerate(req.remote_ids):
            have = np.asarray(held[g].ids if g < len(held) else [], dtype=np.int64)
            missing = np.setdiff1d(ids, have)
            if missing.size:
                raise LeaseRefused(
                    f"remote block IDs {missing[:8].tolist()} of group {g} are not held under"
                    f" request {req.request_id!r} on {link.address}",
                    field=f"remote_block_ids.groups[{g}]",
                    fix="pass exactly the remote_block_ids that Hold returned",
                )

    def _account(self, rec: PullRecord, seconds: float) -> None:
        m = self.metrics
        m.inflight_transfers.dec()
        m.transfers.labels(rec.state.value, rec.strategy).inc()
        m.transfer_seconds.labels(rec.state.value).observe(seconds)
        if rec.state is PullState.DONE:
            m.observe_strategy(rec.strategy, rec.nbytes, rec.stage_times)
            m.transfer_bytes.labels(rec.peer_address).inc(rec.nbytes)
            m.transfer_size_bytes.observe(rec.nbytes)
            m.descriptors.observe(rec.posted_descriptors)
            m.posted_descriptors.inc(rec.posted_descriptors)
            m.naive_descriptors.inc(rec.naive_descriptors)
        log.info(
            "pull finished",
            extra=kv(
                transfer_id=rec.transfer_id,
                request_id=rec.request_id,
                peer=rec.peer_address,
                state=rec.state.value,
                bytes=rec.nbytes,
                descriptors=rec.posted_descriptors,
                naive=rec.naive_descriptors,
                ms=round(seconds * 1e3, 3),
                error=str(rec.error) if rec.error else "",
                strategy=rec.strategy,
                **(rec.stage_times.as_log() if rec.stage_times else {}),
            ),
        )

    async def cancel(self, transfer_id: str) -> PullRecord:
        rec = self.pulls.get(transfer_id)
        if rec.state.terminal:
            return rec
        reader = self.staging.reader if self.staging else None
        if reader is not None and reader.cancel(transfer_id):
            return await self.pulls.wait_terminal(transfer_id)
        fut = self.engine.cancel(transfer_id)
        cancelled = await asyncio.wrap_future(fut)
        if not cancelled:
            # Not posted yet (still confirming): end it here; the task sees a terminal state.
            return self.pulls.update(
                transfer_id,
                state=PullState.CANCELLED,
                error=Cancelled(f"transfer {transfer_id} cancelled by a caller"),
            )
        return await self.pulls.wait_terminal(transfer_id)

    async def watch(self, transfer_ids: frozenset[str]) -> AsyncIterator[PullRecord]:
        for tid in transfer_ids:
            self.pulls.get(tid)  # NotFound for unknown IDs, before streaming
        q = self.pulls.watch(transfer_ids)
        try:
            while True:
                yield await q.get()
        finally:
            self.pulls.unwatch(q)

    def checksum(self, group: int, ids: Sequence[int], *, kernel: bool) -> list[bytes]:
        spec = self.pool.spec
        if not 0 <= group < len(spec.groups):
            raise InvalidRequest(
                f"group {group} does not exist; the spec has {len(spec.groups)}",
                field="group_index",
            )
        g = spec.groups[group]
        if kernel or g.kind.is_state:
            arr = check_block_ids(
                ids, spec.num_kernel_blocks(group), "block_ids", max_ids=self.limits.max_block_ids
            )
            return self.pool.checksums(group, arr.tolist())
        arr = check_block_ids(
            ids, spec.num_logical_blocks(group), "block_ids", max_ids=self.limits.max_block_ids
        )
        digests = self.pool.checksums(group, expand_group(g, arr).tolist())
        return [
            hashlib.blake2b(b"".join(digests[i * g.ppl : (i + 1) * g.ppl]), digest_size=8).digest()
            for i in range(arr.size)
        ]

    # -- lifecycle ----------------------------------------------------------------------------

    def _spawn(self, coro: object) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float) -> int:
        """Stop taking pulls and wait up to ``timeout_s`` for in-flight ones; cancel the rest.

        Returns how many pulls had to be cancelled."""
        self.draining = True
        active = self.pulls.active()
        if not active:
            return 0
        log.info("draining", extra=kv(inflight=len(active), timeout_s=timeout_s))
        waits = [asyncio.ensure_future(self.pulls.wait_terminal(r.transfer_id)) for r in active]
        _, pending = await asyncio.wait(waits, timeout=timeout_s)
        for r in self.pulls.active():
            await self.cancel(r.transfer_id)
        for w in pending:
            w.cancel()
        return len(pending)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _mem_type(remote: RemoteDescription) -> MemType:
    mem = remote.info.spec.regions[0].memory
    return MemType.VRAM if mem is MemoryType.VRAM else MemType.DRAM


__all__ = ["Daemon", "DaemonLimits", "HeldRequest", "NotFound", "PullRequest"]
