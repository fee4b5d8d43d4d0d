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

from kvxferd.blocks import check_block_ids, expand_group, plan_pull
from kvxferd.blocks.ranges import TransferPlan
from kvxferd.daemon.peers import (
    LinkState,
    PeerDirectory,
    PeerLink,
    RemoteDescription,
    SelfDescription,
)
from kvxferd.daemon.pulls import PullBook, PullRecord, PullState
from kvxferd.daemon.sessions import PeerSession, Sessions
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
    UnknownSession,
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
from kvxferd.transfer.engine import Prepared
from kvxferd.transfer.leases import Lease, LeaseView
from kvxferd.transfer.strategy import Strategy
from kvxferd.v1 import spec_pb2

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
    max_deadline_s: float = 600.0  # the longest lease an owner grants (LeaseTable.max_ttl_s)


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
    fingerprint: bytes = b""  # identifies the request for idempotent retries


@dataclass
class _Share:
    """This reader's share of an owner's lease, for one pull."""

    ticket: int  # 0: never confirmed
    valid_until: float  # monotonic; the owner may reuse the blocks after it
    address: str
    done: bool = False
    lost: bool = False


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


class _Twin(Exception):
    """Internal: another StartPull with this transfer ID got there first."""

    def __init__(self, rec: PullRecord) -> None:
        super().__init__(rec.transfer_id)
        self.rec = rec


class _Stages:
    """Where one pull's time went: named marks on the monotonic clock, in the order they
    happen; each stage's duration is its mark minus the previous one."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self._last = t0
        self.items: list[tuple[str, float]] = []

    def mark(self, name: str) -> tuple[tuple[str, float], ...]:
        return self.at(name, time.monotonic())

    def at(self, name: str, t: float) -> tuple[tuple[str, float], ...]:
        if t > 0:
            t = max(t, self._last)
            self.items.append((name, t - self._last))
            self._last = t
        return tuple(self.items)


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
        self.sessions = Sessions(
            liveness_s=limits.heartbeat_timeout_s,
            reading=leases.reading,
            on_retire=self._retire_session,
        )
        self._held: dict[str, HeldRequest] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._confirming: dict[str, asyncio.Future[_Share]] = {}
        self._shares: dict[str, _Share] = {}
        self._posted: set[str] = set()  # pulls whose READ was posted (may write local blocks)
        self._cancel_requested: set[str] = set()
        self._heartbeats: dict[str, asyncio.Task[None]] = {}
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
        if self.staging is not None:
            self.staging.close()  # its owner side, and the KERNEL mappings of its pool
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
            host_id=self.staging.ipc.host_id if self.staging else "",
            ipc=self.staging.ipc_export(served.pool, self.generation) if self.staging else None,
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
        notify.check_request_id(request_id)  # every reader's notification must carry it
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
        if h is None or request_id not in self.leases:
            reason = self.leases.ended(request_id)
            if reason is None:
                raise NotFound(
                    f"request {request_id!r} is not held here (never held, or released long ago)",
                    field="request_id",
                    fix="the prefill engine must Hold the request before the decode side pulls it",
                )
            raise LeaseRefused(
                f"request {request_id!r} is no longer held ({reason.value}); its blocks may be"
                " reused",
                field="request_id",
                fix="do not read: re-run the prefill (or hold with a longer TTL)",
            )
        return h

    # Every reader call below names the caller by its handshake session (kvxferd.daemon.sessions),
    # never by a field of the request.

    def accept_handshake(self, remote: RemoteDescription, who: str) -> PeerSession:
        """A peer handshook: give it a session. Its NIXL metadata is not loaded here: an owner
        only answers READs and receives notifications, and a reader loads what it reads from
        when it handshakes itself (so a handshake never disturbs this daemon's own pulls)."""
        return self.sessions.open(
            remote.agent_name, remote.instance_id, remote.daemon_id, remote.address or who
        )

    def _share_s(self, requested_s: float) -> float:
        """A reader's share lasts what it asked, capped by the heartbeat timeout (heartbeats
        renew it), so a reader that dies frees its blocks within that timeout."""
        cap = self.limits.heartbeat_timeout_s
        return cap if requested_s <= 0 else min(requested_s, cap)

    def confirm_lease(
        self, session: PeerSession, request_id: str, extend_s: float
    ) -> tuple[HeldRequest, LeaseView]:
        self.slot.current()  # EngineDetached: say why, rather than "not held"
        view = self.leases.confirm(request_id, session.reader, self._share_s(extend_s))
        return self.held(request_id), view

    def extend_lease(
        self, session: PeerSession, request_id: str, extend_s: float
    ) -> tuple[HeldRequest, LeaseView]:
        if extend_s <= 0:
            raise InvalidRequest(
                "extend_ms must be > 0", field="extend_ms", fix="send how long to extend, in ms"
            )
        view = self.leases.extend(request_id, session.reader, self._share_s(extend_s))
        return self.held(request_id), view

    def release_lease(
        self, session: PeerSession, request_id: str, *, done: bool
    ) -> tuple[HeldRequest, LeaseView, bool]:
        held = self.held(request_id)
        view, released = self.leases.finish(request_id, session.reader, done=done)
        return held, view, released

    def heartbeat(
        self, session: PeerSession, request_ids: Sequence[str], renew_s: float
    ) -> tuple[list[str], float]:
        """Renew the caller's shares; returns the lost request IDs and how long each renewed
        share now lasts (renew_ms is clamped to the heartbeat timeout, never refused)."""
        granted = self._share_s(renew_s) if renew_s > 0 else 0.0
        return self.leases.renew(session.reader, request_ids, granted), granted

    def _retire_session(self, session: PeerSession) -> None:
        """A reader restarted or was evicted: its shares lapse now, its staging slots return."""
        n = self.leases.reader_gone(session.reader)
        owner = self.staging.owner if self.staging else None
        if owner is not None:
            owner.release_reader(session.reader)
        if n:
            log.warning(
                "reader replaced while reading; its shares lapsed",
                extra=kv(agent=session.agent_name, instance=session.instance_id, shares=n),
            )

    def held_request_ids(self) -> list[str]:
        return list(self._held)

    def watch_releases(self, request_ids: frozenset[str]) -> asyncio.Queue[Release]:
        q: asyncio.Queue[Release] = asyncio.Queue()
        self._release_watchers.append((request_ids, q))
        return q

    def unwatch_releases(self, q: asyncio.Queue[Release]) -> None:
        self._release_watchers = [(i, w) for i, w in self._release_watchers if w is not q]

    # -- reader side (decode) ---------------------------------------------------------------

    async def start_pull(self, req: PullRequest) -> tuple[PullRecord, bool]:
        """Validate, handshake (cached), plan, then run the pull in the background.

        Errors a caller can fix (bad IDs, incompatible or unreachable peer, full queue) are
        raised here, before a transfer exists; later failures end in the pull's status.
        Idempotent on ``transfer_id``: the same request again returns the existing pull and
        ``False``; a different request under the same ID is refused.
        """
        existing = self.pulls.find(req.transfer_id)
        if existing is not None:
            if existing.fingerprint != req.fingerprint:
                raise AlreadyExists(
                    f"transfer {req.transfer_id!r} already exists for a different request",
                    field="transfer_id",
                    fix="use a new transfer_id, or leave it empty to get a generated one",
                )
            return existing, False
        if self.draining:
            raise PeerUnavailable(
                "this daemon is shutting down and takes no new pulls",
                fix="send the pull to another decode daemon",
            )
        if not req.request_id:
            raise InvalidRequest("request_id is empty", field="request_id")
        notify.check_request_id(req.request_id)
        if not req.peer_address:
            raise InvalidRequest(
                "peer_address is empty", field="peer_address", fix="pass HoldResponse.peer_address"
            )
        if not 0 < req.deadline_s <= self.limits.max_deadline_s:
            raise InvalidRequest(
                f"deadline {req.deadline_s:g}s is outside (0, {self.limits.max_deadline_s:g}]",
                field="deadline_ms",
                fix=f"ask for at most {int(self.limits.max_deadline_s * 1000)} ms (the longest"
                " lease an owner grants), or 0 for transfer.default_deadline_ms",
            )
        if self.pulls.num_active >= self.limits.max_inflight:
            raise ResourceExhausted(
                f"{self.limits.max_inflight} pulls are already in flight",
                fix="retry later or raise transfer.max_inflight",
            )
        assert self.peers is not None, "attach_peers() before start_pull()"
        stages = _Stages(time.monotonic())
        deadline = stages.t0 + req.deadline_s  # the handshake is charged to it
        try:
            link = await asyncio.wait_for(
                self.peers.ready(req.peer_address), timeout=req.deadline_s
            )
        except TimeoutError:
            raise DeadlineExceeded(
                f"the handshake with {req.peer_address} outlasted the pull's deadline"
                f" ({req.deadline_s:g}s)",
                field="peer_address",
                fix="check that the peer daemon runs at that address, or raise deadline_ms",
            ) from None
        stages.mark("handshake")
        remote = link.remote
        assert remote is not None
        # The lease confirmation runs while we plan and build descriptors; the READ is posted
        # only once it succeeded (_run_pull), so freed blocks are never read.
        confirming = asyncio.ensure_future(self._confirm(link, req, deadline))
        try:
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
                    link=link,
                )
                log.debug(
                    "pull strategy",
                    extra=kv(
                        transfer_id=req.transfer_id,
                        strategy=decision.choice.strategy.value,
                        reason=decision.choice.reason,
                        chunks=len(decision.chunks),
                    ),
                )
            staged = (
                decision
                if decision and decision.choice.strategy in (Strategy.STAGED, Strategy.KERNEL)
                else None
            )
            stages.mark("plan")
            prepared = (
                None
                if staged is not None
                else self.engine.prepare(req.transfer_id, remote.agent_name, part)
            )
            stages.mark("build")
            existing = self.pulls.find(req.transfer_id)  # a twin raced us through the handshake
            if existing is not None:
                raise _Twin(existing)
        except BaseException as exc:
            self._abandon(confirming, link, req.request_id)
            if isinstance(exc, _Twin):
                return await self.start_pull(req)
            raise
        rec = self.pulls.add(
            PullRecord(
                transfer_id=req.transfer_id,
                request_id=req.request_id,
                peer_address=req.peer_address,
                nbytes=part.nbytes,
                naive_descriptors=part.naive_descriptors,
                deadline_ns=time.time_ns() + int((deadline - time.monotonic()) * 1e9),
                strategy=decision.choice.strategy.value if decision else "DIRECT",
                strategy_reason=decision.choice.reason if decision else "staging not configured",
                fingerprint=req.fingerprint,
            )
        )
        self.metrics.inflight_transfers.inc()
        link.active += 1
        self._ensure_heartbeat(link)
        self._confirming[req.transfer_id] = confirming
        self._spawn(
            self._run_pull(
                req,
                link,
                part,
                plan.local_kernel_blocks,
                deadline=deadline,
                confirming=confirming,
                stages=stages,
                prepared=prepared,
                staged=staged,
                remote_blocks=plan.remote_kernel_blocks,
            )
        )
        return rec, True

    def _abandon(self, confirming: asyncio.Future[_Share], link: PeerLink, rid: str) -> None:
        """A pull that will not run: stop its confirmation, and give back the share if the
        owner granted one."""

        def done(f: asyncio.Future[_Share]) -> None:
            if not f.cancelled() and f.exception() is None:
                self._spawn(self._release_share(link, rid, done=False))

        confirming.add_done_callback(done)
        confirming.cancel()

    async def _run_pull(
        self,
        req: PullRequest,
        link: PeerLink,
        plan: TransferPlan,
        local_blocks: tuple[Int64Array, ...],
        *,
        deadline: float,
        confirming: asyncio.Future[_Share],
        stages: _Stages,
        prepared: Prepared | None,
        staged: Decision | None = None,
        remote_blocks: tuple[Int64Array, ...] = (),
    ) -> None:
        tid = req.transfer_id
        t0 = stages.t0
        share: _Share | None = None
        try:
            self.pulls.update(tid, state=PullState.CONFIRMING, started_ns=time.time_ns())
            try:
                share = await asyncio.wait_for(
                    asyncio.shield(confirming), timeout=max(1e-3, deadline - time.monotonic())
                )
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    confirming.cancel()
                    raise  # the daemon is stopping
                share = None  # CancelTransfer stopped the confirmation: nothing was posted
            except TimeoutError:
                confirming.cancel()
                raise
            finally:
                self._confirming.pop(tid, None)
            stages.mark("confirm")
            self._shares[tid] = share if share is not None else _Share(0, 0.0, link.address)
            # The one decision point: no await between this check and the post, so a cancel
            # either lands before (nothing is read) or after (the READ is cancelled and every
            # local block it may have written is listed).
            if share is None or tid in self._cancel_requested:
                self.pulls.update(
                    tid,
                    state=PullState.CANCELLED,
                    error=Cancelled(
                        f"transfer {tid} cancelled by a caller before its READ was posted;"
                        " no local block was written"
                    ),
                )
                return
            self._posted.add(tid)
            self.pulls.update(tid, state=PullState.TRANSFERRING)
            # The READ carries no notification: the owner hears DONE only once this reader saw
            # its READ complete (after the pull is DONE, in the finally below), so a READ that
            # a cancel cuts short is never counted as read.
            note = b""
            if staged is not None and staged.choice.strategy is Strategy.KERNEL:
                # KERNEL (kvxferd.ipc): one SM copy from the owner's regions mapped over CUDA IPC.
                assert self.staging is not None and link.remote is not None
                result = await self.staging.kernel_pull(
                    tid,
                    link.remote,
                    peer_address=req.peer_address,
                    plan=plan,
                    local_blocks=local_blocks,
                    deadline=deadline,
                )
            elif staged is not None:
                job = self._staged_job(
                    req,
                    link,
                    staged,
                    local_blocks=local_blocks,
                    remote_blocks=remote_blocks,
                    deadline=deadline,
                    notif=note,
                )
                result = await self._staged_pull(job, plan)
            else:
                if prepared is None:
                    prepared = self.engine.prepare(
                        tid, link.remote.agent_name if link.remote else "", plan
                    )
                xfer = self.engine.submit_prepared(
                    prepared, notif=note, timeout_s=max(1e-3, deadline - time.monotonic())
                )
                result = await xfer.wait()
                stages.at("post", result.posted_at)
                stages.at("transfer", result.completed_at)
            state = _TERMINAL[result.status]
            error = result.error or (
                None if state is PullState.DONE else KvxferdError(result.reason)
            )
            invalid = result.invalid_blocks
            if state is PullState.DONE and (share.lost or time.monotonic() > share.valid_until):
                state, invalid = PullState.FAILED, local_blocks
                error = LeaseRefused(
                    f"the lease share on {req.peer_address} lapsed or was lost before the READ"
                    " completed, so the owner may have reused the blocks",
                    field="request_id",
                    fix="pull again after re-running the prefill; check the peers' heartbeats"
                    " (peers.heartbeat_timeout_ms) and load",
                )
            share.done = state is PullState.DONE
            if staged is not None:
                stages.mark("transfer")
            self.pulls.update(
                tid,
                state=state,
                posted_descriptors=result.descriptors,
                error=error,
                invalid_local_blocks=invalid if state is not PullState.DONE else (),
                stages=stages.mark("publish"),
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
                invalid_local_blocks=local_blocks if tid in self._posted else (),
            )
        except KvxferdError as err:
            if isinstance(err, PeerUnavailable) and self.peers is not None:
                await self.peers.invalidate(req.peer_address, str(err))
                self._peer_gauge()
            self.pulls.update(
                tid,
                state=PullState.FAILED,
                error=err,
                invalid_local_blocks=local_blocks if tid in self._posted else (),
            )
        except asyncio.CancelledError:
            self.pulls.update(
                tid,
                state=PullState.CANCELLED,
                error=Cancelled("the daemon stopped before the pull finished"),
                invalid_local_blocks=local_blocks if tid in self._posted else (),
            )
            raise
        except Exception as exc:  # a bug: the pull still ends, listing what it may have written
            log.exception("pull failed unexpectedly", extra=kv(transfer_id=tid))
            if tid in self._posted:
                await asyncio.wrap_future(self.engine.cancel(tid))
            self.pulls.update(
                tid,
                state=PullState.FAILED,
                error=KvxferdError(
                    f"internal error ({type(exc).__name__}: {exc}); this is a kvxferd bug,"
                    " please report it with the daemon's log"
                ),
                invalid_local_blocks=local_blocks if tid in self._posted else (),
            )
        finally:
            link.active -= 1
            self._cancel_requested.discard(tid)
            self._posted.discard(tid)
            held = self._shares.pop(tid, None)
            rec = self.pulls.get(tid)
            if held is not None and held.ticket and held.done and req.notify:
                self._spawn(self._notify_done(link, req.request_id, held.ticket))
            elif (
                held is not None and held.ticket and (held.done or rec.state is PullState.CANCELLED)
            ):
                # Read (no notification asked for), or a caller gave the pull up: end our share
                # now. A FAILED or EXPIRED pull keeps it until it lapses (heartbeat timeout), so
                # the scheduler can retry the same lease from this daemon meanwhile.
                self._spawn(self._release_share(link, req.request_id, done=held.done))
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
        notif: bytes,
    ) -> StagedJob:
        assert link.remote is not None and link.remote.staging is not None
        assert self.peers is not None
        return StagedJob(
            transfer_id=req.transfer_id,
            request_id=req.request_id,
            reader_id=self.agent_name,
            peer_agent=link.remote.agent_name,
            peer_address=req.peer_address,
            client=link.client,
            remote_ring=link.remote.staging,
            local_ids=local_blocks,
            remote_ids=remote_blocks,
            chunks=staged.chunks,
            deadline=deadline,
            notif=notif,
        )

    async def _staged_pull(self, job: StagedJob, plan: TransferPlan) -> TransferResult:
        assert self.staging is not None and self.staging.reader is not None
        try:
            return await self.staging.reader.pull(job, plan.local_kernel_blocks, plan.nbytes)
        finally:
            self.pulls.update(job.transfer_id, stage_times=job.times)

    async def _confirm(self, link: PeerLink, req: PullRequest, deadline: float) -> _Share:
        """Confirm our share of the lease. A peer that restarted (it no longer knows our
        session, or answers with another instance) is handshaken again first: its metadata
        changed, and reading with the old would fail or read the wrong memory."""
        assert self.peers is not None
        for attempt in (1, 2):
            remote = link.remote
            assert remote is not None
            left = deadline - time.monotonic()
            sent = time.monotonic()
            try:
                resp = await link.client.confirm(
                    req.request_id,
                    self.agent_name,
                    int(min(max(1.0, left), self.limits.max_deadline_s) * 1000),
                    left,
                )
            except UnknownSession:
                if attempt == 2:
                    raise
                link.client.session = ""  # the peer forgot it: take the new handshake's
                await self._rehandshake(link, "the peer no longer knows our session")
                continue
            if resp.instance_id and resp.instance_id != remote.instance_id:
                if attempt == 1:
                    await self._rehandshake(link, f"the peer is now instance {resp.instance_id}")
                    continue
                raise PeerUnavailable(
                    f"peer {link.address} changed instance while we confirmed",
                    field="peer_address",
                    fix="retry the pull",
                )
            break
        share = _Share(resp.ticket, sent + resp.lease.remaining_ms / 1000, link.address)
        # The owner re-registered (its engine re-attached): its regions moved.
        await self.peers.refresh(link, resp.lease.registration_generation)
        held = resp.lease.block_ids.groups
        for g, ids in enumerate(req.remote_ids):
            have = np.asarray(held[g].ids if g < len(held) else [], dtype=np.int64)
            missing = np.setdiff1d(ids, have)
            if missing.size:
                self._spawn(self._release_share(link, req.request_id, done=False))
                raise LeaseRefused(
                    f"remote block IDs {missing[:8].tolist()} of group {g} are not held under"
                    f" request {req.request_id!r} on {link.address}",
                    field=f"remote_block_ids.groups[{g}]",
                    fix="pass exactly the remote_block_ids that Hold returned",
                )
        return share

    async def _rehandshake(self, link: PeerLink, why: str) -> None:
        assert self.peers is not None
        log.info("peer restarted; handshaking again", extra=kv(peer=link.address, why=why))
        await self.peers.invalidate(link.address, why, LinkState.STALE)
        await self.peers.ready(link.address)
        self._peer_gauge()

    async def _notify_done(self, link: PeerLink, request_id: str, ticket: int) -> None:
        """Tell the owner we read (the NIXL notification with our ticket; the RPC if NIXL
        cannot deliver it)."""
        agent = link.remote.agent_name if link.remote else ""
        try:
            await asyncio.wrap_future(self.engine.notify(agent, notify.encode(request_id, ticket)))
        except KvxferdError as err:
            log.info("notification failed; releasing by RPC", extra=kv(error=str(err)))
            await self._release_share(link, request_id, done=True)

    async def _release_share(self, link: PeerLink, request_id: str, *, done: bool) -> None:
        """Best effort: tell the owner our share ended (it would lapse anyway)."""
        try:
            await link.client.release(request_id, self.agent_name, done=done)
        except KvxferdError as err:
            log.info(
                "releasing a lease share failed (it lapses on the owner)",
                extra=kv(peer=link.address, request_id=request_id, error=str(err)),
            )

    # -- heartbeats (reader side) ---------------------------------------------------------

    def _ensure_heartbeat(self, link: PeerLink) -> None:
        task = self._heartbeats.get(link.address)
        if task is None or task.done():
            self._heartbeats[link.address] = asyncio.get_running_loop().create_task(
                self._heartbeat_loop(link)
            )

    async def _heartbeat_loop(self, link: PeerLink) -> None:
        """While pulls from ``link`` are in flight, renew their shares and watch for a restart
        or a lost lease; a pull whose share is lost is cancelled (its blocks may be reused)."""
        assert self.peers is not None
        interval = self.limits.heartbeat_interval_s
        while link.active > 0:
            await asyncio.sleep(interval)
            mine = {
                tid: sh
                for tid, sh in self._shares.items()
                if sh.address == link.address and sh.ticket and not sh.done
            }
            if not mine or link.remote is None:
                continue
            rids = {self.pulls.get(tid).request_id: tid for tid in mine}
            sent = time.monotonic()
            try:
                resp = await self.peers.heartbeat(
                    link,
                    list(rids),
                    int(self.limits.heartbeat_timeout_s * 1000),
                    max(interval, 1e-3),
                )
            except KvxferdError as err:
                log.info("heartbeat failed", extra=kv(peer=link.address, error=str(err)))
                continue
            lost = set(resp.lost_request_ids)
            if resp.instance_id != link.remote.instance_id:
                lost = set(rids)
                await self.peers.invalidate(
                    link.address, f"peer restarted (instance {resp.instance_id})", LinkState.STALE
                )
                self._peer_gauge()
            for rid, tid in rids.items():
                share = mine[tid]
                if rid in lost:
                    share.lost = True
                    await self._abort_read(tid, "the owner no longer holds our share of the lease")
                elif resp.renewed_ms:
                    share.valid_until = max(share.valid_until, sent + resp.renewed_ms / 1000)

    async def _abort_read(self, tid: str, why: str) -> None:
        log.warning("lease share lost; cancelling the read", extra=kv(transfer_id=tid, why=why))
        reader = self.staging.reader if self.staging else None
        if reader is not None and reader.cancel(tid):
            return
        await asyncio.wrap_future(self.engine.cancel(tid))

    def _account(self, rec: PullRecord, seconds: float) -> None:
        m = self.metrics
        m.inflight_transfers.dec()
        m.transfers.labels(rec.state.value, rec.strategy).inc()
        m.transfer_seconds.labels(rec.state.value).observe(seconds)
        if rec.state is PullState.DONE:
            for stage, sec in rec.stages:
                m.pull_stage_seconds.labels(stage).observe(sec)
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
        """Cancel a pull. Before its READ is posted, nothing is read (CANCELLED, no block
        listed); after, the READ is cancelled and the pull ends CANCELLED listing every local
        block it may have written, or DONE if the READ completed first."""
        rec = self.pulls.get(transfer_id)
        if rec.state.terminal:
            return rec
        self._cancel_requested.add(transfer_id)
        if transfer_id in self._posted:
            reader = self.staging.reader if self.staging else None
            if reader is None or not reader.cancel(transfer_id):
                await asyncio.wrap_future(self.engine.cancel(transfer_id))
        else:
            confirming = self._confirming.get(transfer_id)
            if confirming is not None:
                confirming.cancel()
        return await self.pulls.wait_terminal(transfer_id)

    async def watch(self, transfer_ids: frozenset[str]) -> AsyncIterator[PullRecord]:
        """Every change of the named pulls (all pulls when empty), after a snapshot of their
        current state; with names, the stream ends once every named pull is terminal."""
        for tid in transfer_ids:
            self.pulls.get(tid)  # NotFound for unknown IDs, before streaming
        q = self.pulls.watch(transfer_ids)
        pending = set(transfer_ids)
        try:
            while True:
                rec = await q.get()
                yield rec
                if transfer_ids and rec.state.terminal:
                    pending.discard(rec.transfer_id)
                    if not pending:
                        return
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
        for hb in self._heartbeats.values():
            hb.cancel()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _mem_type(remote: RemoteDescription) -> MemType:
    mem = remote.info.spec.regions[0].memory
    return MemType.VRAM if mem is MemoryType.VRAM else MemType.DRAM


__all__ = ["Daemon", "DaemonLimits", "HeldRequest", "NotFound", "PullRequest"]
