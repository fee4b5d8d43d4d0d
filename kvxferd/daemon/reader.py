"""The reader role (decode side): pulls, from StartPull to a terminal status.

A pull handshakes (cached per peer), confirms its own share of the owner's lease while it
plans and builds descriptors, posts its READ at one decision point (a cancel lands before it,
nothing is written; after it, every local block the READ may have written is listed), tells
the owner it read only after it saw the READ complete, and heartbeats the owner while it
reads. Strategies: DIRECT (the transfer engine), STAGED, KERNEL and CMA
(:mod:`kvxferd.staging`, :mod:`kvxferd.ipc`); with ``transfer.mode = "push"`` the owner
WRITEs instead (:mod:`kvxferd.daemon.receiver`). Runs on the service loop; NIXL work happens
on the agent's thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.ranges import TransferPlan
from kvxferd.daemon.claims import ReadClaims
from kvxferd.daemon.links import handshaken
from kvxferd.daemon.moves import Mover, account
from kvxferd.daemon.parts import Parts
from kvxferd.daemon.peers import PeerLink
from kvxferd.daemon.pulls import PullBook, PullRecord, PullRequest, PullState, Stages, unix_ns
from kvxferd.daemon.receiver import PushReceiver
from kvxferd.daemon.shares import Share, Shares, check_granted_by_loaded, ends_share, outcome
from kvxferd.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    KvxferdError,
    LeaseRefused,
    PeerUnavailable,
    ResourceExhausted,
)
from kvxferd.ipc.reader import ReadyPull
from kvxferd.logs import kv
from kvxferd.staging.setup import Decision
from kvxferd.tasks import EAGER, start_now
from kvxferd.transfer import TransferStatus
from kvxferd.transfer.engine import Prepared

log = logging.getLogger(__name__)

Int64Array = npt.NDArray[np.int64]

# Loop turns a grpc.aio unary call needs before its request is sent (measured: 1, or 2 with a
# client interceptor); planning first would hold the request back for the whole planning.
RPC_START_TURNS = 3


_AFTER_DETACH = "pull again once this daemon's engine has attached its pool (Describe shows it)"


class _Twin(Exception):
    """Internal: another StartPull with this transfer ID got there first."""

    def __init__(self, rec: PullRecord) -> None:
        super().__init__(rec.transfer_id)
        self.rec = rec


class Reader:
    """The reader side of one daemon."""

    def __init__(self, parts: Parts) -> None:
        self.p = parts
        self.pulls = PullBook(watch_backlog=parts.limits.watch_backlog)
        self.draining = False
        self._confirming: dict[str, asyncio.Future[Share]] = {}
        self._posted: set[str] = set()  # pulls whose READ was posted (may write local blocks)
        self._cancel_requested: dict[str, str] = {}  # transfer ID -> why ("" for a caller)
        self.push = parts.limits.transfer_mode == "push"
        self.receiver = PushReceiver()
        self.shares = Shares(parts, self.pulls, self._abort_read)
        self.claims = ReadClaims()
        self._no_decision = "push mode: the owner WRITEs" if self.push else "staging not configured"
        self._mover = Mover(parts, self.pulls, self.receiver if self.push else None)

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
        req.check(self.p.limits.max_deadline_s)
        if self.pulls.num_active >= self.p.limits.max_inflight:
            raise ResourceExhausted(
                f"{self.p.limits.max_inflight} pulls are already in flight",
                fix="retry later or raise transfer.max_inflight",
            )
        assert self.p.peers is not None, "attach_peers() before start_pull()"
        stages = Stages(req.received or time.monotonic())
        stages.mark("decode")
        deadline = stages.t0 + req.deadline_s  # the handshake is charged to it
        link = self.p.peers.usable(req.peer_address) or await handshaken(
            self.p.peers, req.peer_address, req.deadline_s, "pull"
        )
        stages.mark("handshake")
        remote = link.remote
        assert remote is not None
        # One pull of this daemon reads an owner's request at a time (kvxferd/daemon/claims.py);
        # a refused request that is also malformed is refused as malformed (planning raises).
        try:
            claimed = self.claims.claim(link.address, req.request_id, req.transfer_id)
        except LeaseRefused:
            self._mover.plan(req, remote)
            raise
        if not claimed:  # a twin StartPull (same transfer ID) is starting: answer with its pull
            started = functools.partial(self.pulls.find, req.transfer_id)
            await self.claims.twin(link.address, req.request_id, req.transfer_id, started, deadline)
            return await self.start_pull(req)
        # The confirmation is sent before we plan and build; the owner answers meanwhile. The
        # READ is posted only once it succeeded (_run_pull): freed blocks are never read.
        confirming = start_now(self.shares.confirm(link, req.request_id, req.remote_ids, deadline))
        try:
            # The same-host socket sends in the task's first step (run now where eager, 3.12+).
            turns = RPC_START_TURNS if link.client.local is None else 0 if EAGER else 1
            for _ in range(turns):
                await asyncio.sleep(0)
            plan, part = self._mover.plan(req, remote)
            decision, staged = self._mover.choose(req, link, plan, part)
            stages.mark("plan")
            prepared = self._mover.prepare(req, link, part, staged)
            stages.mark("build")
            existing = self.pulls.find(req.transfer_id)  # a twin raced us through the handshake
            if existing is not None:
                raise _Twin(existing)
        except BaseException as exc:
            self._abandon(confirming, link, req)
            if isinstance(exc, _Twin):
                return await self.start_pull(req)
            raise
        rec = self.pulls.add(
            PullRecord(
                state=PullState.CONFIRMING,  # its confirmation is already in flight
                transfer_id=req.transfer_id,
                request_id=req.request_id,
                peer_address=req.peer_address,
                nbytes=part.nbytes,
                naive_descriptors=part.naive_descriptors,
                deadline_ns=unix_ns(deadline),
                strategy=decision.choice.strategy.value if decision else "DIRECT",
                strategy_reason=decision.choice.reason if decision else self._no_decision,
                fingerprint=req.fingerprint,
                local_ppl=tuple(g.ppl for g in self.p.pool.spec.groups),
            )
        )
        link.active += 1
        self.shares.ensure_heartbeat(link)
        self._confirming[req.transfer_id] = confirming
        # Started now: up to its wait for the confirmation (past it, if the answer is in).
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
            ),
            now=True,
        )
        return rec, True

    def _abandon(self, confirming: asyncio.Future[Share], link: PeerLink, req: PullRequest) -> None:
        """A pull that will not run: stop its confirmation, and give back the share if the
        owner granted one (which ends it: the request stays claimed as read)."""

        def done(f: asyncio.Future[Share]) -> None:
            granted = not f.cancelled() and f.exception() is None
            self.claims.release(link.address, req.request_id, req.transfer_id, ended=granted)
            if granted:
                self.p.spawn(self.shares.release(link, req.request_id, done=False))

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
        confirming: asyncio.Future[Share],
        stages: Stages,
        prepared: Prepared | ReadyPull | None,
        staged: Decision | None = None,
        remote_blocks: tuple[Int64Array, ...] = (),
    ) -> None:
        tid = req.transfer_id
        t0 = stages.t0
        share: Share | None = None
        try:
            try:
                # Awaited directly (a shield would cost a loop turn once the answer is in): a
                # timeout or the daemon stopping cancels this task and so the confirmation.
                async with asyncio.timeout(max(1e-3, deadline - time.monotonic())):
                    share = await confirming
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    confirming.cancel()
                    raise  # the daemon is stopping
                share = None  # CancelTransfer stopped the confirmation: nothing was posted
            except TimeoutError:
                confirming.cancel()
                raise DeadlineExceeded(
                    f"confirming the lease with {req.peer_address} outlasted the deadline",
                    fix="raise deadline_ms or check the peer's health",
                ) from None
            finally:
                self._confirming.pop(tid, None)
            stages.mark("confirm")
            self.shares.by_transfer[tid] = (
                share if share is not None else Share(0, 0.0, link.address)
            )
            # The one decision point: no await between this check and the post, so a cancel
            # either lands before (nothing is read) or after (the READ is cancelled and every
            # local block it may have written is listed).
            if share is None or tid in self._cancel_requested:
                why = self._cancel_requested.get(tid)
                self.pulls.update(
                    tid,
                    state=PullState.CANCELLED,
                    error=Cancelled(
                        f"transfer {tid} {why or 'cancelled by a caller'} before its READ was"
                        " posted; no local block was written",
                        fix=_AFTER_DETACH if why else "",
                    ),
                )
                return
            if not self.push and self.p.peers is not None and share.remote is not None:
                loaded = self.p.peers.loaded(share.remote.agent_name)
                check_granted_by_loaded(share, loaded, req.peer_address)
            self._posted.add(tid)
            self.pulls.update(tid, state=PullState.TRANSFERRING, started_ns=time.time_ns())
            # The owner hears DONE only once this reader saw its READ complete (after the pull
            # is DONE, in the finally below).
            result = await self._mover.move(
                req,
                link,
                plan,
                local_blocks,
                deadline=deadline,
                stages=stages,
                prepared=prepared,
                staged=staged,
                remote_blocks=remote_blocks,
            )
            if self.push and result.status is TransferStatus.DONE:
                share.ticket = 0  # the owner ended our share itself when its WRITE completed
            state, error, invalid = outcome(
                result, share, local_blocks, req.peer_address, tid in self._cancel_requested
            )
            share.done = state is PullState.DONE
            if state is PullState.CANCELLED and (why := self._cancel_requested.get(tid)):
                error = Cancelled(f"transfer {tid} {why} during its READ", fix=_AFTER_DETACH)
            if staged is not None and not result.completed_at:  # CMA marked post/transfer
                stages.mark("transfer")
            # started_unix_ns is when the READ was posted: for a NIXL READ, when its post call
            # began on the NIXL thread (the TRANSFERRING stamp precedes the hand-off to it).
            posted = {"started_ns": unix_ns(t)} if (t := result.post_started_at) else {}
            self.pulls.update(
                tid,
                state=state,
                **posted,
                posted_descriptors=result.descriptors,
                error=error,
                invalid_local_blocks=invalid if state is not PullState.DONE else (),
                stages=stages.mark("publish"),
            )
            if isinstance(result.error, PeerUnavailable) and self.p.peers is not None:
                await self.p.peers.invalidate(req.peer_address, str(result.error))
        except DeadlineExceeded as err:  # the confirmation, or a Peer call, ran out of time
            self.pulls.update(
                tid,
                state=PullState.EXPIRED,
                error=err,
                invalid_local_blocks=local_blocks if tid in self._posted else (),
            )
        except KvxferdError as err:
            if isinstance(err, PeerUnavailable) and self.p.peers is not None:
                await self.p.peers.invalidate(req.peer_address, str(err))
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
            self._cancel_requested.pop(tid, None)
            self._posted.discard(tid)
            held = self.shares.by_transfer.pop(tid, None)
            # A push pull's share has no ticket: the owner ended it once its WRITE was done.
            ended = held is not None and (held.done or ends_share(held, self.pulls.get(tid).state))
            self.claims.release(link.address, req.request_id, tid, ended=ended)
            # Watchers (woken by the terminal update) hear it first; the owner and books after.
            asyncio.get_running_loop().call_soon(
                self._settle, req, link, held, self.pulls.get(tid), time.monotonic() - t0
            )

    def _settle(
        self, req: PullRequest, link: PeerLink, held: Share | None, rec: PullRecord, seconds: float
    ) -> None:
        """After a pull's terminal status went out: settle our lease share, account the pull."""
        if held is not None:
            self.shares.settle(link, req.request_id, held, notify=req.notify, state=rec.state)
        account(self.p.metrics, rec, seconds)

    async def _abort_read(self, tid: str, why: str) -> None:
        log.warning("lease share lost; cancelling the read", extra=kv(transfer_id=tid, why=why))
        if self._mover.cancel(tid) or self.receiver.cancel(tid):  # STAGED or CMA, or a push
            return
        await asyncio.wrap_future(self.p.engine.cancel(tid))

    async def cancel(self, transfer_id: str, why: str = "") -> PullRecord:
        """Cancel a pull. Before its READ is posted, nothing is read (CANCELLED, no block
        listed); after, the READ is cancelled and the pull ends CANCELLED listing every local
        block it may have written, or DONE if the READ completed first. Returns once it ended:
        nothing of it writes into the pool any more. ``why`` replaces "cancelled by a caller"
        in its error (the daemon's own reasons: its pool went away)."""
        rec = self.pulls.get(transfer_id)
        if rec.state.terminal:
            return rec
        self._cancel_requested.setdefault(transfer_id, why)
        if transfer_id in self._posted:
            pushed = self.receiver.cancel(transfer_id)  # a push: the owner's WRITE stops
            if not pushed and not self._mover.cancel(transfer_id):  # STAGED or CMA stop
                await asyncio.wrap_future(self.p.engine.cancel(transfer_id))
        else:
            confirming = self._confirming.get(transfer_id)
            if confirming is not None:
                confirming.cancel()
        return await self.pulls.wait_terminal(transfer_id)
