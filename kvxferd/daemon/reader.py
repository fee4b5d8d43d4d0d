"""The reader role (decode side): pulls, from StartPull to a terminal status.

A pull handshakes (cached per peer), confirms its own share of the owner's lease while it
plans and builds descriptors, posts its READ at one decision point (a cancel lands before it,
nothing is written; after it, every local block the READ may have written is listed), tells
the owner it read only after it saw the READ complete, and heartbeats the owner while it
reads. Strategies: DIRECT (the transfer engine), STAGED and KERNEL (:mod:`kvxferd.staging`,
:mod:`kvxferd.ipc`); with ``transfer.mode = "push"`` the owner WRITEs instead
(:mod:`kvxferd.daemon.receiver`). Runs on the service loop; NIXL work happens on the agent's
thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxferd.blocks import plan_pull
from kvxferd.blocks.ranges import TransferPlan
from kvxferd.daemon.parts import Parts
from kvxferd.daemon.peers import LinkState, PeerLink
from kvxferd.daemon.pulls import PullBook, PullRecord, PullState
from kvxferd.daemon.receiver import PushReceiver
from kvxferd.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    InvalidRequest,
    KvxferdError,
    LeaseRefused,
    PeerUnavailable,
    ResourceExhausted,
    UnknownSession,
)
from kvxferd.logs import kv
from kvxferd.peers import compat_digest
from kvxferd.staging.reader import StagedJob
from kvxferd.staging.setup import Decision, decide
from kvxferd.staging.strategy import Strategy
from kvxferd.transfer import TransferResult, TransferStatus, notify
from kvxferd.transfer.engine import Prepared

log = logging.getLogger(__name__)

Int64Array = npt.NDArray[np.int64]

_TERMINAL = {
    TransferStatus.DONE: PullState.DONE,
    TransferStatus.FAILED: PullState.FAILED,
    TransferStatus.CANCELLED: PullState.CANCELLED,
    TransferStatus.EXPIRED: PullState.EXPIRED,
}


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


class Reader:
    """The reader side of one daemon."""

    def __init__(self, parts: Parts) -> None:
        self.p = parts
        self.pulls = PullBook()
        self.draining = False
        self._confirming: dict[str, asyncio.Future[_Share]] = {}
        self._shares: dict[str, _Share] = {}
        self._posted: set[str] = set()  # pulls whose READ was posted (may write local blocks)
        self._cancel_requested: set[str] = set()
        self._heartbeats: dict[str, asyncio.Task[None]] = {}
        self.receiver = PushReceiver()
        self.push = parts.limits.transfer_mode == "push"

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
        if not 0 < req.deadline_s <= self.p.limits.max_deadline_s:
            raise InvalidRequest(
                f"deadline {req.deadline_s:g}s is outside (0, {self.p.limits.max_deadline_s:g}]",
                field="deadline_ms",
                fix=f"ask for at most {int(self.p.limits.max_deadline_s * 1000)} ms (the longest"
                " lease an owner grants), or 0 for transfer.default_deadline_ms",
            )
        if self.pulls.num_active >= self.p.limits.max_inflight:
            raise ResourceExhausted(
                f"{self.p.limits.max_inflight} pulls are already in flight",
                fix="retry later or raise transfer.max_inflight",
            )
        assert self.p.peers is not None, "attach_peers() before start_pull()"
        stages = _Stages(time.monotonic())
        deadline = stages.t0 + req.deadline_s  # the handshake is charged to it
        try:
            link = await asyncio.wait_for(
                self.p.peers.ready(req.peer_address), timeout=req.deadline_s
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
                self.p.pool.spec,
                remote.info.spec,
                list(req.local_ids),
                list(req.remote_ids),
                prefix_caching=self.p.info.prefix_caching,
                local_tp=(self.p.info.tp_rank, self.p.info.tp_size),
                remote_tp=(remote.info.tp_rank, remote.info.tp_size),
                max_ids=self.p.limits.max_block_ids,
            )
            part = plan.per_rank.get(remote.info.tp_rank) or TransferPlan(ranges=())
            decision = None
            if self.p.staging is not None and not self.push:
                decision = decide(
                    self.p.staging,
                    local=self.p.pool.spec,
                    remote=remote.info.spec,
                    local_tp_size=self.p.info.tp_size,
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
                if staged is not None or self.push
                else self.p.engine.prepare(req.transfer_id, remote.agent_name, part)
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
                strategy_reason=decision.choice.reason
                if decision
                else "push mode: the owner WRITEs"
                if self.push
                else "staging not configured",
                fingerprint=req.fingerprint,
            )
        )
        self.p.metrics.inflight_transfers.inc()
        link.active += 1
        self._ensure_heartbeat(link)
        self._confirming[req.transfer_id] = confirming
        self.p.spawn(
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
                self.p.spawn(self._release_share(link, rid, done=False))

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
            if self.push:  # the owner WRITEs; DONE when its notification lands
                result = await self.receiver.receive(
                    tid,
                    req.request_id,
                    link,
                    remote_ids=req.remote_ids,
                    local_ids=req.local_ids,
                    plan=plan,
                    deadline=deadline,
                )
                stages.at("post", result.posted_at)
                stages.at("transfer", result.completed_at)
                if result.status is TransferStatus.DONE:
                    share.ticket = 0  # the owner ended our share itself when its WRITE completed
            elif staged is not None and staged.choice.strategy is Strategy.KERNEL:
                # KERNEL (kvxferd.ipc): one SM copy from the owner's regions mapped over CUDA IPC.
                assert self.p.staging is not None and link.remote is not None
                result = await self.p.staging.kernel_pull(
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
                agent = link.remote.agent_name if link.remote else ""
                if prepared is None or prepared.peer != agent:
                    # Built before the confirmation, which may have found a restarted owner
                    # (a new NIXL agent): build against the peer we confirmed with.
                    prepared = self.p.engine.prepare(tid, agent, plan)
                xfer = self.p.engine.submit_prepared(
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
            if isinstance(result.error, PeerUnavailable) and self.p.peers is not None:
                await self.p.peers.invalidate(req.peer_address, str(result.error))
                self.p.peer_gauge()
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
            if isinstance(err, PeerUnavailable) and self.p.peers is not None:
                await self.p.peers.invalidate(req.peer_address, str(err))
                self.p.peer_gauge()
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
                await asyncio.wrap_future(self.p.engine.cancel(tid))
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
                self.p.spawn(self._notify_done(link, req.request_id, held.ticket))
            elif (
                held is not None and held.ticket and (held.done or rec.state is PullState.CANCELLED)
            ):
                # Read (no notification asked for), or a caller gave the pull up: end our share
                # now. A FAILED or EXPIRED pull keeps it until it lapses (heartbeat timeout), so
                # the scheduler can retry the same lease from this daemon meanwhile.
                self.p.spawn(self._release_share(link, req.request_id, done=held.done))
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
        assert self.p.peers is not None
        return StagedJob(
            transfer_id=req.transfer_id,
            request_id=req.request_id,
            reader_id=self.p.agent_name,
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
        assert self.p.staging is not None and self.p.staging.reader is not None
        try:
            return await self.p.staging.reader.pull(job, plan.local_kernel_blocks, plan.nbytes)
        finally:
            self.pulls.update(job.transfer_id, stage_times=job.times)

    async def _confirm(self, link: PeerLink, req: PullRequest, deadline: float) -> _Share:
        """Confirm our share of the lease. A peer that restarted (it no longer knows our
        session, or answers with another instance) is handshaken again first: its metadata
        changed, and reading with the old would fail or read the wrong memory."""
        assert self.p.peers is not None
        for attempt in (1, 2):
            remote = link.remote
            assert remote is not None
            left = deadline - time.monotonic()
            sent = time.monotonic()
            try:
                resp = await link.client.confirm(
                    req.request_id,
                    self.p.agent_name,
                    int(min(max(1.0, left), self.p.limits.max_deadline_s) * 1000),
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
        await self.p.peers.refresh(link, resp.lease.registration_generation)
        held = resp.lease.block_ids.groups
        for g, ids in enumerate(req.remote_ids):
            have = np.asarray(held[g].ids if g < len(held) else [], dtype=np.int64)
            missing = np.setdiff1d(ids, have)
            if missing.size:
                self.p.spawn(self._release_share(link, req.request_id, done=False))
                raise LeaseRefused(
                    f"remote block IDs {missing[:8].tolist()} of group {g} are not held under"
                    f" request {req.request_id!r} on {link.address}",
                    field=f"remote_block_ids.groups[{g}]",
                    fix="pass exactly the remote_block_ids that Hold returned",
                )
        return share

    async def _rehandshake(self, link: PeerLink, why: str) -> None:
        assert self.p.peers is not None
        log.info("peer restarted; handshaking again", extra=kv(peer=link.address, why=why))
        before = link.remote
        await self.p.peers.invalidate(link.address, why, LinkState.STALE)
        await self.p.peers.ready(link.address)
        self.p.peer_gauge()
        after = link.remote
        if (
            before is not None
            and after is not None
            and (
                compat_digest(before.info.spec) != compat_digest(after.info.spec)
                or (before.info.tp_rank, before.info.tp_size)
                != (after.info.tp_rank, after.info.tp_size)
            )
        ):
            raise PeerUnavailable(
                f"peer {link.address} restarted with a different KV layout or TP rank than this"
                " pull was planned for",
                field="peer_address",
                fix="start the pull again: it is planned against the new layout",
            )

    async def _notify_done(self, link: PeerLink, request_id: str, ticket: int) -> None:
        """Tell the owner we read (the NIXL notification with our ticket; the RPC if NIXL
        cannot deliver it)."""
        agent = link.remote.agent_name if link.remote else ""
        try:
            note = notify.encode(request_id, ticket)
            await asyncio.wrap_future(self.p.engine.notify(agent, note))
        except KvxferdError as err:
            log.info("notification failed; releasing by RPC", extra=kv(error=str(err)))
            await self._release_share(link, request_id, done=True)

    async def _release_share(self, link: PeerLink, request_id: str, *, done: bool) -> None:
        """Best effort: tell the owner our share ended (it would lapse anyway)."""
        try:
            await link.client.release(request_id, self.p.agent_name, done=done)
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
        assert self.p.peers is not None
        interval = self.p.limits.heartbeat_interval_s
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
                resp = await self.p.peers.heartbeat(
                    link,
                    list(rids),
                    int(self.p.limits.heartbeat_timeout_s * 1000),
                    max(interval, 1e-3),
                )
            except KvxferdError as err:
                log.info("heartbeat failed", extra=kv(peer=link.address, error=str(err)))
                continue
            lost = set(resp.lost_request_ids)
            if resp.instance_id != link.remote.instance_id:
                lost = set(rids)
                await self.p.peers.invalidate(
                    link.address, f"peer restarted (instance {resp.instance_id})", LinkState.STALE
                )
                self.p.peer_gauge()
            for rid, tid in rids.items():
                share = mine[tid]
                if rid in lost:
                    share.lost = True
                    await self._abort_read(tid, "the owner no longer holds our share of the lease")
                elif resp.renewed_ms:
                    share.valid_until = max(share.valid_until, sent + resp.renewed_ms / 1000)

    async def _abort_read(self, tid: str, why: str) -> None:
        log.warning("lease share lost; cancelling the read", extra=kv(transfer_id=tid, why=why))
        reader = self.p.staging.reader if self.p.staging else None
        if (reader is not None and reader.cancel(tid)) or self.receiver.cancel(tid):
            return
        await asyncio.wrap_future(self.p.engine.cancel(tid))

    def _account(self, rec: PullRecord, seconds: float) -> None:
        m = self.p.metrics
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
            reader = self.p.staging.reader if self.p.staging else None
            if self.receiver.cancel(transfer_id):
                pass  # a push: its Push call (hence the owner's WRITE) is cancelled
            elif reader is None or not reader.cancel(transfer_id):
                await asyncio.wrap_future(self.p.engine.cancel(transfer_id))
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

    def stop_heartbeats(self) -> None:
        for hb in self._heartbeats.values():
            hb.cancel()
