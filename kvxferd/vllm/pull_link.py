"""The connector's pulls on its local daemon (no vLLM import): :class:`PullLink` starts each
pull on the daemon's Scheduler service and reports it terminal to the worker.

Two ways, by what the daemon serves (``PoolInfo.scheduler_socket``): on its scheduler socket
(``server.scheduler_socket``, :mod:`kvxferd.wire.scheduler_socket`), one StartPull with
``wait`` per pull on a background thread, answered with the terminal status; otherwise
StartPull over gRPC, then ``WatchTransfers`` on a background thread until it is terminal.
Failures carry the daemon's own explanation (:func:`kvxferd.vllm.daemon.rpc_error`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvxferd.logs import kv
from kvxferd.v1 import scheduler_pb2, scheduler_pb2_grpc
from kvxferd.vllm.daemon import (
    CALL_TIMEOUT_S,
    TERMINAL,
    _metadata,
    explain,
    rpc_error,
)
from kvxferd.wire.codec import group_ids_from_proto, group_ids_to_proto
from kvxferd.wire.peer_client import RpcFailure
from kvxferd.wire.scheduler_socket import SchedulerSockets

log = logging.getLogger(__name__)

SETTLE_POLL_S = 0.05  # a pull whose watch broke: how often its status is asked until it ends
MAX_PULL_DEADLINE_MS = 600_000  # the longest pull deadline a daemon accepts (Limits.max_deadline_s)


@dataclass
class PullResult:
    """A terminal pull."""

    request_id: str
    transfer_id: str
    state: str
    invalid_local: tuple[int, ...] = ()
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    local: tuple[tuple[int, ...], ...] = field(default=())


def state_name(state: int) -> str:
    return scheduler_pb2.TransferState.Name(state).removeprefix("TRANSFER_STATE_")  # type: ignore[arg-type]


def _code(exc: grpc.RpcError) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.Call | RpcFailure) else None


def _refused(
    req: scheduler_pb2.StartPullRequest,
    where: str,
    exc: grpc.RpcError,
    local: tuple[tuple[int, ...], ...],
) -> PullResult:
    """A StartPull the daemon at ``where`` refused, with its explanation."""
    err = rpc_error("Scheduler.StartPull", where, exc)
    return PullResult(req.request_id, req.transfer_id, "REFUSED", error=str(err), local=local)


class PullLink:
    """The local daemon's Scheduler service at ``address``, and its scheduler socket at
    ``socket`` when it serves one (PoolInfo.scheduler_socket): a pull is then one StartPull
    with ``wait`` on the socket, answered with its terminal status (no stream)."""

    def __init__(self, address: str, *, token: str = "", socket: str = "") -> None:
        self.address = address
        self._md = _metadata(token)
        self._channel = grpc.insecure_channel(address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._sockets = SchedulerSockets(socket) if socket else None

    def start(
        self,
        transfer_id: str,
        request_id: str,
        peer_address: str,
        remote: Sequence[Sequence[int]],
        local: Sequence[Sequence[int]],
        *,
        deadline_ms: int,
        on_done: Callable[[PullResult], None],
    ) -> None:
        """StartPull, then follow it on a thread; ``on_done`` gets the terminal result (also
        when StartPull itself is refused)."""
        req = scheduler_pb2.StartPullRequest(
            transfer_id=transfer_id,
            request_id=request_id,
            peer_address=peer_address,
            remote_block_ids=group_ids_to_proto([list(g) for g in remote]),
            local_block_ids=group_ids_to_proto([list(g) for g in local]),
            deadline_ms=deadline_ms,
        )
        loc = tuple(tuple(int(b) for b in g) for g in local)
        if self._sockets is not None:
            target: Any = self._wait
            args: tuple[Any, ...] = (req, loc, on_done)
        else:
            sent_ns = time.time_ns()
            try:
                st = self._stub.StartPull(req, timeout=CALL_TIMEOUT_S, metadata=self._md).status
            except grpc.RpcError as exc:
                if _code(exc) != grpc.StatusCode.DEADLINE_EXCEEDED:
                    on_done(_refused(req, self.address, exc, loc))
                    return
                target, args = self._unknown, (req, sent_ns, exc, loc, on_done)
            else:
                target, args = self._follow, (st, loc, on_done)
        threading.Thread(
            target=target, args=args, name=f"kvxferd-pull-{transfer_id[:24]}", daemon=True
        ).start()

    def _wait(
        self,
        req: scheduler_pb2.StartPullRequest,
        local: tuple[tuple[int, ...], ...],
        on_done: Callable[[PullResult], None],
    ) -> None:
        """StartPull with ``wait`` on the scheduler socket. A socket that breaks or times out
        leaves it unknown whether the pull started: the same StartPull (idempotent on its
        transfer_id) then goes over gRPC, and the pull is followed there."""
        assert self._sockets is not None
        timeout = req.deadline_ms / 1000 + CALL_TIMEOUT_S  # the pull ends by its deadline
        lost = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        try:
            req.wait = True
            resp = self._sockets.call("StartPull", req, timeout=timeout, metadata=self._md)
            self._report(resp.status, local, on_done)
            return
        except RpcFailure as exc:
            if exc.code() not in lost:
                on_done(_refused(req, self._sockets.path, exc, local))
                return
        req.wait = False
        sent_ns = time.time_ns()
        try:
            st = self._stub.StartPull(req, timeout=CALL_TIMEOUT_S, metadata=self._md).status
        except grpc.RpcError as exc:
            if _code(exc) not in lost:
                on_done(_refused(req, self.address, exc, local))
                return
            # Neither way answered: the socket's StartPull may be running the pull.
            self._unknown(req, sent_ns, exc, local, on_done)
            return
        self._follow(st, local, on_done)

    def _unknown(
        self,
        req: scheduler_pb2.StartPullRequest,
        sent_ns: int,
        exc: grpc.RpcError,
        local: tuple[tuple[int, ...], ...],
        on_done: Callable[[PullResult], None],
    ) -> None:
        """A StartPull whose outcome is unknown (no answer, in time or at all): the pull may be
        running, so it is not REFUSED (vLLM would reuse blocks the daemon may still write) but
        settled like a pull whose watch broke. Its deadline counts from when the daemon got it,
        at the latest within CALL_TIMEOUT_S of ``sent_ns``; a pull of the daemon's default
        deadline (``deadline_ms`` 0) ends by the longest deadline a daemon accepts."""
        ms = req.deadline_ms or MAX_PULL_DEADLINE_MS
        st = scheduler_pb2.TransferStatus(
            transfer_id=req.transfer_id,
            request_id=req.request_id,
            deadline_unix_ns=sent_ns + ms * 1_000_000,
        )
        why = str(rpc_error("Scheduler.StartPull", self.address, exc))
        self._settled(self._settle(st, f"StartPull got no answer: {why}"), why, local, on_done)

    def _follow(
        self,
        st: scheduler_pb2.TransferStatus,
        local: tuple[tuple[int, ...], ...],
        on_done: Callable[[PullResult], None],
    ) -> None:
        last, why = st, "the watch ended before the pull did"
        try:
            if st.state not in TERMINAL:
                for msg in self._stub.WatchTransfers(
                    scheduler_pb2.WatchTransfersRequest(transfer_ids=[st.transfer_id]),
                    metadata=self._md,
                ):
                    last = msg.status
                    if last.state in TERMINAL:
                        break
        except grpc.RpcError as exc:
            why = str(rpc_error("Scheduler.WatchTransfers", self.address, exc))
        if last.state not in TERMINAL:
            last = self._settle(last, why)
        self._settled(last, why, local, on_done)

    def _settled(
        self,
        last: scheduler_pb2.TransferStatus,
        why: str,
        local: tuple[tuple[int, ...], ...],
        on_done: Callable[[PullResult], None],
    ) -> None:
        """Report a pull :meth:`_settle` waited for: its terminal state, or LOST once its
        deadline has passed without one (every local block a load error)."""
        if last.state not in TERMINAL:
            on_done(PullResult(last.request_id, last.transfer_id, "LOST", error=why, local=local))
            return
        self._report(last, local, on_done)

    def _settle(self, st: scheduler_pb2.TransferStatus, why: str) -> scheduler_pb2.TransferStatus:
        """The pull's watch broke (or its StartPull got no answer): it may still be writing
        into vLLM's blocks, which must not be freed or recomputed before it ends. Cancel it and
        ask for its status until it is terminal, or until its deadline has passed (the daemon
        ends every pull by then; one that cannot be reached meanwhile is reported LOST only
        after that). The daemon's own deadline replaces ``st``'s once it answers."""
        give_up = st.deadline_unix_ns / 1e9 + CALL_TIMEOUT_S if st.deadline_unix_ns else 0.0
        log.warning(
            "pull's outcome is unknown; cancelling it and waiting until it ends",
            extra=kv(transfer_id=st.transfer_id, why=why),
        )
        with contextlib.suppress(grpc.RpcError):
            self._stub.CancelTransfer(
                scheduler_pb2.CancelTransferRequest(transfer_id=st.transfer_id),
                timeout=CALL_TIMEOUT_S,
                metadata=self._md,
            )
        last = st
        while True:
            with contextlib.suppress(grpc.RpcError):
                last = self._stub.GetTransfer(
                    scheduler_pb2.GetTransferRequest(transfer_id=st.transfer_id),
                    timeout=CALL_TIMEOUT_S,
                    metadata=self._md,
                ).status
            if last.deadline_unix_ns:  # the daemon's own deadline, once it answered
                give_up = last.deadline_unix_ns / 1e9 + CALL_TIMEOUT_S
            if last.state in TERMINAL or time.time() > give_up:
                return last
            time.sleep(SETTLE_POLL_S)

    def _report(
        self,
        last: scheduler_pb2.TransferStatus,
        local: tuple[tuple[int, ...], ...],
        on_done: Callable[[PullResult], None],
    ) -> None:
        invalid = tuple(
            int(b) for g in group_ids_from_proto(last.invalid_local_block_ids) for b in g
        )
        secs = (
            (last.finished_unix_ns - last.created_unix_ns) / 1e9 if last.finished_unix_ns else 0.0
        )
        on_done(
            PullResult(
                last.request_id,
                last.transfer_id,
                state_name(last.state),
                invalid,
                explain(last.error) if last.HasField("error") else "",
                int(last.nbytes),
                secs,
                local,
            )
        )

    def decline(self, request_id: str, peer_address: str) -> None:
        """Tell the prefill daemon at ``peer_address`` (through the local daemon's
        DeclinePull) that ``request_id`` will not be pulled: it frees the held blocks now, not
        at the lease's TTL. Best effort, on a thread; a failure is logged (the TTL still
        frees them)."""
        req = scheduler_pb2.DeclinePullRequest(request_id=request_id, peer_address=peer_address)
        threading.Thread(
            target=self._decline, args=(req,), name="kvxferd-decline", daemon=True
        ).start()

    def _decline(self, req: scheduler_pb2.DeclinePullRequest) -> None:
        try:
            if self._sockets is not None:
                self._sockets.call("DeclinePull", req, timeout=CALL_TIMEOUT_S, metadata=self._md)
            else:
                self._stub.DeclinePull(req, timeout=CALL_TIMEOUT_S, metadata=self._md)
        except grpc.RpcError as exc:  # RpcFailure too (the scheduler socket's)
            err = rpc_error("Scheduler.DeclinePull", self.address, exc)
            log.warning(
                "declining a held request failed; the prefill daemon frees it at its TTL",
                extra=kv(request_id=req.request_id, peer=req.peer_address, error=str(err)),
            )

    def close(self) -> None:
        self._channel.close()
        if self._sockets is not None:
            self._sockets.close()


__all__ = ["PullLink", "PullResult", "state_name"]
