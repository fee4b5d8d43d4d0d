"""The reader side of push mode (decode): ask the owner to WRITE, complete on its notification.

A push-mode pull runs the reader's usual lifecycle (:mod:`kvxferd.daemon.reader`: handshake,
the same planning and trimming, a confirmed share of the owner's lease, heartbeats, one decision
point, one terminal status); only the data movement differs. :meth:`PushReceiver.receive`:

* takes this daemon's own lease on the local blocks the WRITE will fill: a random 64-bit
  ticket, registered with the blocks until the pull ends; only a WRITE_DONE notification
  carrying that ticket, for that request, from the agent of the owner it asked, completes it
  (:meth:`PushReceiver.landed`, called by the notification pump on the NIXL thread);
* asks the owner over ``Peer.Push`` to WRITE, with a WRITE timeout shorter than the pull's
  remaining deadline, so the owner cancels its WRITE before this pull can end EXPIRED and its
  blocks be reused;
* ends DONE when the notification lands, FAILED when the owner refused or its WRITE failed,
  EXPIRED when the deadline passed first (the call is then cancelled, which cancels the WRITE);
  every end but DONE lists every local block the WRITE may have touched;
* never ends (nor lets :meth:`PushReceiver.settle`, hence an engine detach, return) while the
  owner's WRITE may still land. Only the owner's answer to its Push call (sent once its WRITE
  completed, failed or was cancelled at its timeout) says so: a cancelled push, or one past
  its deadline, waits for it, and the call is not cancelled meanwhile (that would lose the
  answer). No clock of ours bounds a stalled owner (stopped, paused, starved: its WRITE goes on
  when it resumes), so a push whose owner is silent stays TRANSFERRING past its deadline,
  saying so in the log, for up to :data:`SILENT_OWNER_S`. An owner whose connection broke
  before it answered is waited out to its WRITE timeout, the one bound a running owner keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.ranges import TransferPlan
from kvxferd.daemon.peers import PeerLink
from kvxferd.errors import DeadlineExceeded, KvxferdError, PeerUnavailable
from kvxferd.logs import kv
from kvxferd.transfer import TransferResult, TransferStatus, notify
from kvxferd.transfer.descriptors import plan_runs
from kvxferd.v1 import peer_pb2
from kvxferd.wire.codec import group_ids_to_proto

log = logging.getLogger(__name__)

Int64Array = npt.NDArray[np.int64]

MIN_WRITE_MARGIN_S = 0.05
MAX_WRITE_MARGIN_S = 1.0
# How long past a pull's deadline a push waits for a silent owner's answer before it ends
# anyway (its blocks listed; docs/nixl.md §9), and how often it says so meanwhile.
SILENT_OWNER_S = 300.0
STALL_LOG_S = 10.0


def write_timeout_s(left_s: float) -> float:
    """How long the owner's WRITE may take when the pull has ``left_s``: a quarter of it kept
    back (50 ms to 1 s), so the owner gives up on its WRITE before this pull's deadline."""
    return left_s - min(MAX_WRITE_MARGIN_S, max(MIN_WRITE_MARGIN_S, left_s / 4))


def descriptors(plan: TransferPlan) -> int:
    """How many descriptors the owner posts for ``plan`` (ranges coalesced as it does)."""
    return int(plan_runs(plan)[0].size)


async def _sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.monotonic()))


async def _answer(
    call: asyncio.Task[peer_pb2.PushResponse],
    lease: _Lease,
    transfer_id: str,
    address: str,
    deadline: float,
) -> None:
    """Wait for the owner's answer to ``call`` (its WRITE is over then: written, failed, or
    cancelled at its timeout) or for the WRITE to land. An owner that has not answered by the
    pull's deadline is stalled (stopped, paused, starved): it may still WRITE when it resumes,
    so the wait goes on, said in the log, until the call's own limit
    (:data:`SILENT_OWNER_S` past the deadline), or until its connection breaks."""
    waits: set[asyncio.Future[Any]] = {call, lease.landed}
    left = max(0.0, deadline - time.monotonic())
    await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
    while not call.done() and not lease.landed.done():
        log.warning(
            "push past its deadline with no answer from the owner; its blocks are not given"
            " back while its WRITE may still land",
            extra=kv(
                transfer_id=transfer_id, peer=address, late_s=round(time.monotonic() - deadline, 1)
            ),
        )
        await asyncio.wait(waits, timeout=STALL_LOG_S, return_when=asyncio.FIRST_COMPLETED)


def _answered(call: asyncio.Task[peer_pb2.PushResponse]) -> None:
    """The owner's late answer to a push that already landed: only logged."""
    if call.cancelled():
        return
    err = call.exception()
    if err is not None:
        log.info("the owner answered a landed push with an error", extra=kv(error=str(err)))


@dataclass
class _Lease:
    """Local blocks a push will write, until its pull ends."""

    request_id: str
    agent: str
    blocks: tuple[Int64Array, ...]
    loop: asyncio.AbstractEventLoop
    landed: asyncio.Future[float]  # resolves to the monotonic time the notification was seen


class PushReceiver:
    """Push mode, reader side (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # landed() runs on the NIXL thread
        self._leases: dict[int, _Lease] = {}
        self._calls: dict[str, asyncio.Task[peer_pb2.PushResponse]] = {}
        self._stops: dict[str, asyncio.Event] = {}  # transfer ID -> cancel asked
        self._ended: dict[str, asyncio.Future[None]] = {}  # transfer ID -> receive() returned

    def receiving(self) -> dict[str, tuple[Int64Array, ...]]:
        """Request ID -> local blocks under a push not yet landed."""
        with self._lock:
            return {x.request_id: x.blocks for x in self._leases.values()}

    def expecting(self) -> bool:
        """Whether a WRITE_DONE is due (the pump then polls notifications back to back)."""
        return bool(self._leases)

    def landed(self, sender: str, note: notify.Notification) -> bool:
        """A WRITE_DONE notification (NIXL thread): True if it completed a push we wait for."""
        with self._lock:
            lease = self._leases.get(note.ticket)
        if lease is None or lease.request_id != note.request_id or lease.agent != sender:
            return False
        t = time.monotonic()
        lease.loop.call_soon_threadsafe(
            lambda: None if lease.landed.done() else lease.landed.set_result(t)
        )
        return True

    def cancel(self, transfer_id: str) -> bool:
        """Cancel a push in flight: it ends CANCELLED once the owner's WRITE can no longer land
        (see the module); False when no push of that ID is in flight."""
        stop = self._stops.get(transfer_id)
        if stop is None:
            return False
        stop.set()
        return True

    async def settle(self) -> int:
        """Cancel every push in flight and wait until each has ended (its WRITE can no longer
        land), e.g. before the pool it writes into is freed. Returns how many were in flight."""
        ended = list(self._ended.values())
        for stop in self._stops.values():
            stop.set()
        if ended:
            await asyncio.wait(ended)
        return len(ended)

    async def receive(
        self,
        transfer_id: str,
        request_id: str,
        link: PeerLink,
        *,
        remote_ids: tuple[Int64Array, ...],
        local_ids: tuple[Int64Array, ...],
        plan: TransferPlan,
        deadline: float,
    ) -> TransferResult:
        """Have the owner WRITE ``plan`` (its ``local_kernel_blocks`` are ours) and wait for it."""
        assert link.remote is not None
        agent = link.remote.agent_name
        ticket = secrets.randbits(64) | 1
        loop = asyncio.get_running_loop()
        lease = _Lease(request_id, agent, plan.local_kernel_blocks, loop, loop.create_future())
        posted = time.monotonic()
        left = deadline - posted
        req = peer_pb2.PushRequest(
            request_id=request_id,
            remote_block_ids=group_ids_to_proto(remote_ids),
            local_block_ids=group_ids_to_proto(local_ids),
            notif_ticket=ticket,
            write_timeout_ms=max(1, int(write_timeout_s(left) * 1000)),
            transfer_id=transfer_id,
        )
        # The owner's WRITE ends by its timeout, counted from when the Push reached it.
        fence = posted + write_timeout_s(left) + MIN_WRITE_MARGIN_S
        with self._lock:
            self._leases[ticket] = lease
        # No time limit of our own ends the call before the owner answers: a stalled owner
        # (stopped, paused) may still WRITE when it resumes (see the module).
        call = loop.create_task(link.client.push(req, left + SILENT_OWNER_S))
        stop = asyncio.Event()
        stopped = loop.create_task(stop.wait())
        self._calls[transfer_id] = call
        self._stops[transfer_id] = stop
        self._ended[transfer_id] = loop.create_future()
        try:
            waits: set[asyncio.Future[Any]] = {call, lease.landed, stopped}
            await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            cancelled = stop.is_set() and not lease.landed.done()
            if not lease.landed.done() and not call.done():
                # Cancelled, or past the deadline: the WRITE is over only once the owner says so.
                await _answer(call, lease, transfer_id, link.address, deadline)
            if lease.landed.done():
                # Landed: DONE now. The owner's answer follows (it ends our share when it saw
                # its WRITE complete); cancelling the call would stop that, so it is left.
                call.add_done_callback(_answered)
                return self._landed(transfer_id, agent, plan, lease, posted)
            err = None if call.cancelled() else call.exception()
            if err is not None and (
                not isinstance(err, KvxferdError) or isinstance(err, PeerUnavailable)
            ):
                await _sleep_until(fence)  # no answer: its WRITE may run until its timeout
            if cancelled or call.cancelled():
                return self._end(transfer_id, agent, plan, TransferStatus.CANCELLED, posted=posted)
            if err is not None:
                error = err if isinstance(err, KvxferdError) else KvxferdError(str(err))
                if time.monotonic() >= deadline + SILENT_OWNER_S:
                    log.error(
                        "ending a push whose owner never answered; its WRITE may still land in"
                        " the blocks now listed as not written",
                        extra=kv(transfer_id=transfer_id, peer=link.address),
                    )
                status = (
                    TransferStatus.EXPIRED
                    if isinstance(error, DeadlineExceeded)
                    else TransferStatus.FAILED
                )
                return self._end(transfer_id, agent, plan, status, posted=posted, error=error)
            # Written (the owner said so): the notification is due until the deadline.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.shield(lease.landed), max(1e-3, deadline - time.monotonic())
                )
            if lease.landed.done():
                return self._landed(transfer_id, agent, plan, lease, posted)
            return self._end(
                transfer_id,
                agent,
                plan,
                TransferStatus.EXPIRED,
                posted=posted,
                error=DeadlineExceeded(
                    f"the push of {request_id!r} from {link.address} did not land within the"
                    " pull's deadline",
                    fix="raise deadline_ms, or check the prefill daemon's health and load",
                ),
            )
        finally:
            with self._lock:
                self._leases.pop(ticket, None)
            self._calls.pop(transfer_id, None)
            self._stops.pop(transfer_id, None)
            stopped.cancel()
            if not call.done() and not lease.landed.done():
                call.cancel()
            ended = self._ended.pop(transfer_id)
            if not ended.done():
                ended.set_result(None)

    @classmethod
    def _landed(
        cls, transfer_id: str, agent: str, plan: TransferPlan, lease: _Lease, posted: float
    ) -> TransferResult:
        """DONE: the WRITE's notification landed (every block written)."""
        return cls._end(
            transfer_id,
            agent,
            plan,
            TransferStatus.DONE,
            posted=posted,
            completed=lease.landed.result(),
            descriptors=descriptors(plan),
        )

    @staticmethod
    def _end(
        transfer_id: str,
        agent: str,
        plan: TransferPlan,
        status: TransferStatus,
        *,
        posted: float,
        error: KvxferdError | None = None,
        completed: float = 0.0,
        descriptors: int = 0,
    ) -> TransferResult:
        now = time.monotonic()
        done = status is TransferStatus.DONE
        return TransferResult(
            transfer_id,
            agent,
            status,
            reason=str(error) if error else "",
            error=error,
            invalid_blocks=() if done else plan.local_kernel_blocks,
            nbytes=plan.nbytes,
            descriptors=descriptors,
            elapsed_s=(completed or now) - posted,
            posted_at=posted,
            completed_at=completed or now,
        )
