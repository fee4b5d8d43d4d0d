"""Transfers posted to NIXL, on the NIXL thread: post, poll back to back, end each one.

:class:`InFlight` owns what only the NIXL thread touches: the posted transfers, and the
handles NIXL refused to free yet (retried on later polls). Every end goes through
:meth:`InFlight.finish`, which releases the handle, resolves the transfer's future and tells
the engine (``on_end``) so that it frees the peer's byte budget.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from kvxferd.blocks.ranges import TransferPlan
from kvxferd.errors import Cancelled, DeadlineExceeded, KvxferdError, PeerUnavailable
from kvxferd.logs import kv
from kvxferd.nixl import MemType, NixlAgent, XferHandle, XferOp, XferState
from kvxferd.transfer.descriptors import Int64Array
from kvxferd.transfer.state import TransferResult, TransferStatus

log = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass
class Transfer:
    """A submitted transfer; ``future`` resolves to its :class:`TransferResult`."""

    transfer_id: str
    peer: str
    op: XferOp
    plan: TransferPlan
    nbytes: int
    descriptors: int
    created_at: float
    deadline: float
    future: Future[TransferResult] = field(default_factory=Future, repr=False)
    status: TransferStatus = TransferStatus.QUEUED
    _local: Int64Array | None = field(default=None, repr=False)
    _remote: Int64Array | None = field(default=None, repr=False)
    _notif: bytes = field(default=b"", repr=False)
    _handle: XferHandle | None = field(default=None, repr=False)
    # What it was admitted against: the peer's entry and the local regions of its descriptors
    # (TransferEngine); checked when it is posted, and its bytes are returned to that entry.
    _peer_state: object = field(default=None, repr=False)
    _local_table: object = field(default=None, repr=False)
    post_started_at: float = 0.0  # the data plane starts: the post call begins
    posted_at: float = 0.0  # the post call returned

    async def wait(self) -> TransferResult:
        return await asyncio.wrap_future(self.future)

    def result(self, timeout: float | None = None) -> TransferResult:
        return self.future.result(timeout)


class InFlight:
    """The NIXL thread's side of a :class:`~kvxferd.transfer.engine.TransferEngine`.

    ``mems(peer)``: (local, remote) memory types for a post, None once the peer is gone.
    ``stale(transfer)``: why a transfer may no longer be posted (the peer it was built for was
    replaced, or the local regions were swapped since), or ``""``; asked right before each
    post, on the NIXL thread, which also runs every replacement and swap.
    ``on_end(transfer)``: called once per transfer as it ends, before its future resolves."""

    def __init__(
        self,
        agent: NixlAgent,
        *,
        mems: Callable[[str], tuple[MemType, MemType] | None],
        stale: Callable[[Transfer], str],
        on_end: Callable[[Transfer], None],
        min_poll_s: float,
        max_poll_s: float,
        clock: Clock = time.monotonic,
    ) -> None:
        self._agent = agent
        self._mems = mems
        self._stale = stale
        self._on_end = on_end
        self._min_poll_s = min_poll_s
        self._max_poll_s = max_poll_s
        self._clock = clock
        self._active: list[Transfer] = []
        self._zombies: list[XferHandle] = []  # handles NIXL refused to free yet

    @property
    def unreleased_handles(self) -> int:
        """Handles of ended transfers that NIXL has not freed yet (0 when all is well)."""
        return len(self._zombies)

    def post_failed(self, xfer: Transfer, fut: Future[None]) -> None:
        # The NIXL thread stopped before the post ran: the transfer still needs an end.
        exc = fut.exception()
        if exc is not None and not xfer.future.done():
            err = exc if isinstance(exc, KvxferdError) else PeerUnavailable(str(exc))
            self.finish(xfer, TransferStatus.FAILED, err)

    def post(self, xfer: Transfer) -> None:
        if xfer.status.terminal:
            return
        if xfer.nbytes == 0:
            self._finish_empty(xfer)
            return
        now = self._clock()
        if now >= xfer.deadline:
            self.finish(
                xfer,
                TransferStatus.EXPIRED,
                DeadlineExceeded("deadline passed before the transfer was posted"),
            )
            return
        assert xfer._local is not None and xfer._remote is not None
        why = self._stale(xfer)
        if why:  # its descriptors point at memory that is no longer the peer's, or ours
            self.finish(xfer, TransferStatus.CANCELLED, Cancelled(why, fix="retry the pull"))
            return
        mems = self._mems(xfer.peer)
        xfer.post_started_at = now
        try:
            if mems is None:
                raise PeerUnavailable(f"peer {xfer.peer} was disconnected")
            xfer._handle = self._agent.post(
                xfer.op,
                xfer._local,
                xfer._remote,
                peer=xfer.peer,
                local_mem=mems[0],
                remote_mem=mems[1],
                notif=xfer._notif,
            )
        except KvxferdError as err:
            self.finish(xfer, TransferStatus.FAILED, err)
            return
        xfer.status = TransferStatus.IN_PROGRESS
        xfer.posted_at = self._clock()
        self._active.append(xfer)

    def _finish_empty(self, xfer: Transfer) -> None:
        # Full prefix hit: nothing to read, but the owner still counts this reader as done.
        if xfer._notif:
            try:
                self._agent.send_notif(xfer.peer, xfer._notif)
            except KvxferdError as err:
                log.warning(
                    "transfer notification not sent",
                    extra=kv(transfer_id=xfer.transfer_id, peer=xfer.peer, error=str(err)),
                )
        self.finish(xfer, TransferStatus.DONE, None)

    def poll(self) -> float | None:
        if self._zombies:
            self._zombies = [h for h in self._zombies if not self._agent.release(h)]
        if not self._active:
            return None if not self._zombies else self._max_poll_s
        now = self._clock()
        for xfer in list(self._active):
            assert xfer._handle is not None
            try:
                state = self._agent.poll(xfer._handle)
            except KvxferdError as err:
                self.finish(xfer, TransferStatus.FAILED, err)
                continue
            if state is XferState.DONE:
                self.finish(xfer, TransferStatus.DONE, None)
            elif state is XferState.FAILED:
                self.finish(
                    xfer,
                    TransferStatus.FAILED,
                    PeerUnavailable("NIXL reported the transfer failed"),
                )
            elif now >= xfer.deadline:
                self.finish(
                    xfer,
                    TransferStatus.EXPIRED,
                    DeadlineExceeded(
                        f"transfer still in progress after {xfer.deadline - xfer.created_at:.3f}s",
                        fix="the peer may be stopped or overloaded; retry with a new lease",
                    ),
                )
        # While anything is in flight, check back to back: the short sleep only lets the event
        # loop's thread take the GIL. Idle, the poller asks for nothing (no CPU).
        if not self._active:
            return None
        next_deadline = min(x.deadline for x in self._active)
        return max(0.0, min(self._min_poll_s, next_deadline - now))

    def finish(self, xfer: Transfer, status: TransferStatus, err: KvxferdError | None) -> None:
        post_us = xfer_us = ndesc = None
        handle = xfer._handle
        if handle is not None:
            if status is TransferStatus.DONE:
                tel = self._agent.telemetry(handle)
                if tel is not None:
                    post_us, xfer_us, ndesc = tel.post_us, tel.xfer_us, tel.descriptors
            if not self._agent.release(handle):
                self._zombies.append(handle)
        if xfer in self._active:
            self._active.remove(xfer)
        xfer.status = status
        xfer._local = xfer._remote = None
        self._on_end(xfer)
        invalid = () if status is TransferStatus.DONE else xfer.plan.local_kernel_blocks
        result = TransferResult(
            xfer.transfer_id,
            xfer.peer,
            status,
            reason=str(err) if err else "",
            error=err,
            invalid_blocks=tuple(np.asarray(b, dtype=np.int64) for b in invalid),
            nbytes=xfer.nbytes,
            descriptors=xfer.descriptors,
            elapsed_s=self._clock() - xfer.created_at,
            post_us=post_us,
            xfer_us=xfer_us,
            nixl_descriptors=ndesc,
            post_started_at=xfer.post_started_at if xfer.posted_at else 0.0,
            posted_at=xfer.posted_at,
            completed_at=self._clock(),
        )
        if not xfer.future.done():
            xfer.future.set_result(result)  # before the log line: the waiting loop wakes now
        level = logging.DEBUG if status is TransferStatus.DONE else logging.WARNING
        if log.isEnabledFor(level):  # a DONE is logged only at debug: build nothing then
            log.log(
                level,
                "transfer ended",
                extra=kv(
                    transfer_id=xfer.transfer_id,
                    peer=xfer.peer,
                    status=status.value,
                    bytes=xfer.nbytes,
                    descriptors=xfer.descriptors,
                    elapsed_ms=round(result.elapsed_s * 1e3, 3),
                    reason=result.reason or "-",
                ),
            )


__all__ = ["InFlight", "Transfer"]
