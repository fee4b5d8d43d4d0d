"""How a confirmed pull moves its bytes: the owner WRITEs (push mode), one SM copy over CUDA
IPC (KERNEL), batched process_vm_readv calls from a same-host owner's host memory (CMA), staged
chunks (STAGED), or one NIXL READ (DIRECT); and the record a finished pull leaves in the
metrics and the log.

:class:`Mover` is called by the reader (:mod:`kvxferd.daemon.reader`) after the lease share is
confirmed, at its one decision point; it only moves bytes and returns the transfer's result.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import numpy.typing as npt

from kvxferd.blocks import plan_pull
from kvxferd.blocks.ranges import PullPlan, TransferPlan
from kvxferd.daemon.parts import Parts
from kvxferd.daemon.peers import PeerLink, RemoteDescription
from kvxferd.daemon.pulls import PullBook, PullRecord, PullRequest, PullState, Stages
from kvxferd.daemon.receiver import PushReceiver
from kvxferd.ipc.eligibility import kernel_only_refusal
from kvxferd.ipc.reader import ReadyPull
from kvxferd.logs import kv
from kvxferd.metrics import Metrics
from kvxferd.staging.reader import StagedJob
from kvxferd.staging.setup import Decision, decide
from kvxferd.staging.strategy import Strategy
from kvxferd.transfer import TransferResult
from kvxferd.transfer.engine import Prepared

log = logging.getLogger(__name__)

Int64Array = npt.NDArray[np.int64]
_NOT_NIXL_READ = (Strategy.STAGED, Strategy.KERNEL, Strategy.CMA)


class Mover:
    """Moves one confirmed pull's bytes with the strategy it was given."""

    def __init__(self, parts: Parts, pulls: PullBook, receiver: PushReceiver | None) -> None:
        self.p = parts
        self.pulls = pulls
        self.receiver = receiver  # set in push mode: the owner WRITEs

    def plan(self, req: PullRequest, remote: RemoteDescription) -> tuple[PullPlan, TransferPlan]:
        """Plan the pull (kvxferd.blocks): the whole plan and the part read from this peer's
        rank. Pure (no I/O): the lease confirmation's RPC is in flight meanwhile."""
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
        return plan, plan.per_rank.get(remote.info.tp_rank) or TransferPlan(ranges=())

    def choose(
        self, req: PullRequest, link: PeerLink, plan: PullPlan, part: TransferPlan
    ) -> tuple[Decision | None, Decision | None]:
        """Pick the pull's strategy: the decision (None without staging or in push mode) and
        the decision again when it is STAGED, KERNEL or CMA (None for DIRECT and push)."""
        remote = link.remote
        assert remote is not None
        decision = None
        if self.p.staging is not None and self.receiver is None:
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
            if log.isEnabledFor(logging.DEBUG):  # its fields are built only when logged
                log.debug(
                    "pull strategy",
                    extra=kv(
                        transfer_id=req.transfer_id,
                        strategy=decision.choice.strategy.value,
                        reason=decision.choice.reason,
                        chunks=len(decision.chunks),
                    ),
                )
        staged = decision if decision and decision.choice.strategy in _NOT_NIXL_READ else None
        return decision, staged

    def prepare(
        self, req: PullRequest, link: PeerLink, part: TransferPlan, staged: Decision | None
    ) -> Prepared | ReadyPull | None:
        """The host work a pull can do before its lease is confirmed (the READ or copy itself
        waits for the confirmation): DIRECT's descriptor lists, KERNEL's checked pieces and
        launch tables; None for the other strategies and in push mode."""
        remote = link.remote
        assert remote is not None
        if self.receiver is not None:
            return None
        if staged is None:
            return self.p.engine.prepare(req.transfer_id, remote.agent_name, part)
        if staged.choice.strategy is Strategy.KERNEL and self.p.staging is not None:
            return self.p.staging.kernel_ready(remote, part)
        return None

    async def move(
        self,
        req: PullRequest,
        link: PeerLink,
        plan: TransferPlan,
        local_blocks: tuple[Int64Array, ...],
        *,
        deadline: float,
        stages: Stages,
        prepared: Prepared | ReadyPull | None,
        staged: Decision | None,
        remote_blocks: tuple[Int64Array, ...],
    ) -> TransferResult:
        # The READ carries no notification: the owner hears DONE only once the reader saw its
        # READ complete, so a READ that a cancel cuts short is never counted as read.
        self._check_nixl_pools(req, link, plan, staged)
        if self.receiver is not None:  # the owner WRITEs; DONE when its notification lands
            result = await self.receiver.receive(
                req.transfer_id,
                req.request_id,
                link,
                remote_ids=req.remote_ids,
                local_ids=req.local_ids,
                plan=plan,
                deadline=deadline,
            )
            stages.at("post", result.posted_at)
            stages.at("transfer", result.completed_at)
        elif staged is not None and staged.choice.strategy is Strategy.KERNEL:
            # KERNEL (kvxferd.ipc): one SM copy from the owner's regions mapped over CUDA IPC.
            assert self.p.staging is not None and link.remote is not None
            result = await self.p.staging.kernel_pull(
                req.transfer_id,
                link.remote,
                peer_address=req.peer_address,
                plan=plan,
                local_blocks=local_blocks,
                deadline=deadline,
                ready=prepared if isinstance(prepared, ReadyPull) else None,
            )
        elif staged is not None and staged.choice.strategy is Strategy.CMA:
            # CMA (kvxferd.ipc.cma_reader): process_vm_readv from the owner's process, which
            # the link's same-host socket vouches for (SO_PEERCRED), never the handshake.
            assert self.p.staging is not None
            result = await self.p.staging.cma_pull(
                req.transfer_id,
                link,
                peer_address=req.peer_address,
                plan=plan,
                local_blocks=local_blocks,
                deadline=deadline,
            )
            stages.at("post", result.posted_at)  # the ranges built and checked: copying starts
            stages.at("transfer", result.completed_at)
        elif staged is not None:
            job = self._staged_job(
                req,
                link,
                staged,
                local_blocks=local_blocks,
                remote_blocks=remote_blocks,
                deadline=deadline,
                notif=b"",
            )
            result = await self._staged_pull(job, plan)
        else:
            agent = link.remote.agent_name if link.remote else ""
            if not isinstance(prepared, Prepared) or prepared.peer != agent:
                # Built before the confirmation, which may have found a restarted owner
                # (a new NIXL agent): build against the peer we confirmed with.
                prepared = self.p.engine.prepare(req.transfer_id, agent, plan)
            xfer = self.p.engine.submit_prepared(
                prepared, notif=b"", timeout_s=max(1e-3, deadline - time.monotonic())
            )
            result = await xfer.wait()
            stages.at("post", result.posted_at)
            stages.at("transfer", result.completed_at)
        return result

    def cancel(self, transfer_id: str) -> bool:
        """Stop a running STAGED or CMA pull (each checks between chunks or calls); False when
        neither runs it (a NIXL READ, or nothing)."""
        s = self.p.staging
        if s is None:
            return False
        if s.reader is not None and s.reader.cancel(transfer_id):
            return True
        return s.cma is not None and s.cma.cancel(transfer_id)

    def _check_nixl_pools(
        self, req: PullRequest, link: PeerLink, plan: TransferPlan, staged: Decision | None
    ) -> None:
        """Refuse a NIXL pull (DIRECT or STAGED) whose owner turned KERNEL-only after the pull
        was planned: the lease confirmation re-handshakes with an owner whose engine
        re-attached meanwhile, and an IMPORTED VRAM pool is not registered with NIXL."""
        strategy = staged.choice.strategy if staged is not None else Strategy.DIRECT
        remote = link.remote
        if strategy not in (Strategy.DIRECT, Strategy.STAGED) or remote is None:
            return
        local_only = self.p.staging.ipc.publisher.kernel_only if self.p.staging else ""
        refused = kernel_only_refusal(
            strategy=strategy.value,
            why_not_kernel="the pull was planned as "
            f"{strategy.value} before the owner's engine re-attached",
            nbytes=plan.nbytes,
            remote_kernel_only=remote.kernel_only,
            local_kernel_only=local_only,
            peer=req.peer_address,
        )
        if refused is not None:
            raise refused

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


def account(metrics: Metrics, rec: PullRecord, seconds: float) -> None:
    """A finished pull: its metrics and its one INFO line."""
    m = metrics
    m.child(m.transfers, rec.state.value, rec.strategy).inc()
    m.child(m.transfer_seconds, rec.state.value).observe(seconds)
    if rec.state is PullState.DONE:
        for stage, sec in rec.stages:
            m.child(m.pull_stage_seconds, stage).observe(sec)
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
