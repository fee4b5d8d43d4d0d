"""Scheduler and engine calls over the real gRPC API, for the demo, the benchmarks and tests.

:class:`DaemonClient` wraps one daemon: its Scheduler service (TCP) and Engine service (Unix
socket). It is built on the public scheduler client :mod:`kvxferd.client` (its channel options,
auth metadata, ``StartPull`` request and error type: :class:`RpcFailure` is a
:class:`kvxferd.client.KvxferdRpcError`) and adds what a harness needs beyond a scheduler: the
engine side (``Describe``, ``Hold``), raw ``TransferStatus`` messages (per-stage times),
``Checksum`` by kernel block in chunks. :class:`TransferWatcher` keeps one ``WatchTransfers``
stream open for every pull and records, for each transfer a caller said it expects, the moment
its terminal status arrived. :class:`ReleaseWatcher` follows the prefill engine's
``WatchReleases`` stream.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from kvxferd.client import KvxferdRpcError
from kvxferd.client.requests import channel_options, metadata, start_request
from kvxferd.layout.spec import KVCacheSpec
from kvxferd.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from kvxferd.wire.codec import group_ids_to_proto, spec_from_proto
from kvxferd.wire.scheduler_socket import SchedulerSocket

TERMINAL = frozenset(
    {
        scheduler_pb2.TRANSFER_STATE_DONE,
        scheduler_pb2.TRANSFER_STATE_FAILED,
        scheduler_pb2.TRANSFER_STATE_CANCELLED,
        scheduler_pb2.TRANSFER_STATE_EXPIRED,
    }
)
CALL_TIMEOUT_S = 30.0
CHECKSUM_TIMEOUT_S = 120.0
CHECKSUM_CHUNK = 512  # kernel block IDs per Checksum call
# kvxferd.client's channel (message size limits) without its retries: a harness call that
# fails says so at once.
_CHANNEL_OPTIONS = channel_options(False, ())

IdLists = Sequence[Sequence[int] | npt.NDArray[np.int64]]


def state_name(state: int) -> str:
    """``TRANSFER_STATE_DONE`` -> ``DONE``."""
    return scheduler_pb2.TransferState.Name(state).removeprefix("TRANSFER_STATE_")  # type: ignore[arg-type]


class RpcFailure(KvxferdRpcError):
    """:class:`kvxferd.client.KvxferdRpcError` (status code, message, the daemon's typed error
    when it sent one) named after the daemon it came from, with the lines the demo prints."""

    @classmethod
    def of(cls, method: str, exc: KvxferdRpcError) -> RpcFailure:
        return cls(method, exc.code, exc.details, exc.error)

    def explain(self) -> list[str]:
        """Lines: the status, then every mismatch (with its fix) when the error lists them."""
        lines = [f"{self.code.name}: {self.details}"]
        if self.error is not None:
            for m in self.error.mismatches:
                lines.append(f"  - {m.what}: local {m.local}, remote {m.remote}")
                if m.fix:
                    lines.append(f"    fix: {m.fix}")
            if self.error.fix and not self.error.mismatches:
                lines.append(f"  fix: {self.error.fix}")
        return lines


def rpc_failure(method: str, exc: grpc.RpcError) -> RpcFailure:
    """Turn a raised ``grpc.RpcError`` into :class:`RpcFailure` (reading the error trailer as
    :mod:`kvxferd.client` does)."""
    return RpcFailure.of(method, KvxferdRpcError.wrap(method, exc))


class DaemonClient:
    """One daemon's Scheduler (``grpc_address``) and Engine (``engine_socket``) services."""

    def __init__(
        self,
        name: str,
        grpc_address: str,
        engine_socket: str,
        token: str = "",
        scheduler_socket: str = "",
    ) -> None:
        self.name = name
        self.grpc_address = grpc_address
        self.metadata: tuple[tuple[str, str], ...] = metadata(token)
        self._channel = grpc.insecure_channel(grpc_address, options=_CHANNEL_OPTIONS)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self._channel)
        # The daemon's scheduler socket (server.scheduler_socket), for calls made with local=True.
        self.socket = SchedulerSocket(scheduler_socket) if scheduler_socket else None
        self._engine_channel: grpc.Channel | None = None
        self.engine: engine_pb2_grpc.EngineStub | None = None
        if engine_socket:
            self._engine_channel = grpc.insecure_channel(
                f"unix:{engine_socket}", options=_CHANNEL_OPTIONS
            )
            self.engine = engine_pb2_grpc.EngineStub(self._engine_channel)

    def close(self) -> None:
        self._channel.close()
        if self.socket is not None:
            self.socket.close()
        if self._engine_channel is not None:
            self._engine_channel.close()

    def _engine(self) -> engine_pb2_grpc.EngineStub:
        if self.engine is None:
            raise RpcFailure(
                "Engine",
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{self.name} has no engine socket",
                None,
            )
        return self.engine

    # -- engine service ---------------------------------------------------------------------

    def describe(self) -> engine_pb2.PoolInfo:
        try:
            resp = self._engine().Describe(
                engine_pb2.DescribeRequest(), timeout=CALL_TIMEOUT_S, metadata=self.metadata
            )
        except grpc.RpcError as exc:
            raise rpc_failure(f"{self.name} Describe", exc) from None
        return resp.pool

    def spec(self) -> KVCacheSpec:
        return spec_from_proto(self.describe().spec, where=f"{self.name}.pool.spec")

    def hold(
        self, request_id: str, block_ids: IdLists, *, readers: int = 1, ttl_ms: int = 0
    ) -> engine_pb2.HoldResponse:
        req = engine_pb2.HoldRequest(
            request_id=request_id,
            block_ids=group_ids_to_proto(block_ids),
            expected_readers=readers,
            ttl_ms=ttl_ms,
        )
        try:
            resp: engine_pb2.HoldResponse = self._engine().Hold(
                req, timeout=CALL_TIMEOUT_S, metadata=self.metadata
            )
        except grpc.RpcError as exc:
            raise rpc_failure(f"{self.name} Hold", exc) from None
        return resp

    # -- scheduler service ------------------------------------------------------------------

    def _unary(self, local: bool) -> Any:
        """The stub for a unary Scheduler call: gRPC, or with ``local`` the scheduler socket."""
        if local and self.socket is None:
            why = f"{self.name} serves no scheduler socket"
            raise RpcFailure("Scheduler", grpc.StatusCode.FAILED_PRECONDITION, why, None)
        return self.socket if local else self.scheduler

    def start_pull(
        self,
        transfer_id: str,
        hold: engine_pb2.HoldResponse,
        local_ids: IdLists,
        *,
        deadline_ms: int = 0,
        wait_s: float = 0.0,
        local: bool = False,
    ) -> scheduler_pb2.StartPullResponse:
        """StartPull; with ``wait_s`` > 0, StartPull with ``wait`` (the answer is the terminal
        status), given that long; with ``local``, on the daemon's scheduler socket."""
        req = start_request(
            request_id=hold.request_id,
            peer_address=hold.peer_address,
            remote_block_ids=hold.remote_block_ids,
            local_block_ids=group_ids_to_proto(local_ids),
            transfer_id=transfer_id,
            deadline_ms=deadline_ms,
            skip_notify=False,
            wait=wait_s > 0,
        )
        try:
            resp: scheduler_pb2.StartPullResponse = self._unary(local).StartPull(
                req, timeout=wait_s or CALL_TIMEOUT_S, metadata=self.metadata
            )
        except grpc.RpcError as exc:
            raise rpc_failure(f"{self.name} StartPull", exc) from None
        return resp

    def get_transfer(
        self, transfer_id: str, *, local: bool = False
    ) -> scheduler_pb2.TransferStatus:
        try:
            resp: scheduler_pb2.GetTransferResponse = self._unary(local).GetTransfer(
                scheduler_pb2.GetTransferRequest(transfer_id=transfer_id),
                timeout=CALL_TIMEOUT_S,
                metadata=self.metadata,
            )
        except grpc.RpcError as exc:
            raise rpc_failure(f"{self.name} GetTransfer", exc) from None
        return resp.status

    def checksum(self, group: int, kernel_ids: npt.ArrayLike) -> list[bytes]:
        """BLAKE2b-64 digests of kernel blocks of ``group``, one per ID, in order."""
        ids = np.asarray(kernel_ids, dtype=np.int64).reshape(-1)
        out: list[bytes] = []
        for start in range(0, ids.size, CHECKSUM_CHUNK):
            chunk = ids[start : start + CHECKSUM_CHUNK]
            req = scheduler_pb2.ChecksumRequest(
                group_index=group,
                block_ids=chunk.tolist(),
                algorithm=scheduler_pb2.CHECKSUM_ALGORITHM_BLAKE2B_64,
                kernel_block_ids=True,
            )
            try:
                resp = self.scheduler.Checksum(
                    req, timeout=CHECKSUM_TIMEOUT_S, metadata=self.metadata
                )
            except grpc.RpcError as exc:
                raise rpc_failure(f"{self.name} Checksum", exc) from None
            if len(resp.digests) != chunk.size:
                raise RpcFailure(
                    f"{self.name} Checksum",
                    grpc.StatusCode.INTERNAL,
                    f"asked {chunk.size} digests, got {len(resp.digests)}",
                    None,
                )
            out.extend(bytes(d) for d in resp.digests)
        return out


@dataclass
class Pending:
    """A transfer a caller waits for; ``terminal_at`` is ``time.perf_counter()`` on arrival."""

    transfer_id: str
    event: threading.Event = field(default_factory=threading.Event)
    status: scheduler_pb2.TransferStatus | None = None
    terminal_at: float = 0.0
    via: str = "WatchTransfers"


class TransferWatcher:
    """One ``WatchTransfers`` stream over every transfer of a daemon, read on a thread.

    Call :meth:`expect` *before* ``StartPull`` (the stream may report the end first), then
    :meth:`wait`. If the stream breaks, waiters fall back to polling ``GetTransfer``.
    """

    POLL_S = 0.02

    def __init__(self, client: DaemonClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._pending: dict[str, Pending] = {}
        self.error = ""
        self._closing = False
        self._call = client.scheduler.WatchTransfers(
            scheduler_pb2.WatchTransfersRequest(), metadata=client.metadata
        )
        self._call.initial_metadata()  # the watch is registered: no pull's end is missed
        self._thread = threading.Thread(target=self._run, name=f"watch-{client.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for resp in self._call:
                st = resp.status
                if st.state not in TERMINAL:
                    continue
                now = time.perf_counter()
                with self._lock:
                    p = self._pending.get(st.transfer_id)
                if p is not None and not p.event.is_set():
                    p.status, p.terminal_at = st, now
                    p.event.set()
            if not self._closing:
                self.error = "the WatchTransfers stream ended"
        except grpc.RpcError as exc:
            if not self._closing:
                self.error = str(rpc_failure(f"{self._client.name} WatchTransfers", exc))

    def expect(self, transfer_id: str) -> Pending:
        p = Pending(transfer_id)
        with self._lock:
            self._pending[transfer_id] = p
        return p

    def resolve(self, p: Pending, status: scheduler_pb2.TransferStatus, via: str) -> None:
        """Record a terminal status seen elsewhere (StartPull already terminal, GetTransfer)."""
        if not p.event.is_set():
            p.status, p.terminal_at, p.via = status, time.perf_counter(), via
            p.event.set()

    def wait(self, p: Pending, timeout_s: float) -> scheduler_pb2.TransferStatus:
        """The terminal status of ``p``; TimeoutError if it is not terminal in time."""
        deadline = time.monotonic() + timeout_s
        while not p.event.wait(self.POLL_S if self.error else 0.25):
            if self.error:  # no stream: poll
                st = self._client.get_transfer(p.transfer_id)
                if st.state in TERMINAL:
                    self.resolve(p, st, "GetTransfer")
                    break
            if time.monotonic() > deadline:
                st = self._client.get_transfer(p.transfer_id)
                if st.state in TERMINAL:
                    self.resolve(p, st, "GetTransfer (missed on the stream)")
                    break
                raise TimeoutError(
                    f"transfer {p.transfer_id} is still {state_name(st.state)} after"
                    f" {timeout_s:.0f}s"
                )
        with self._lock:
            self._pending.pop(p.transfer_id, None)
        assert p.status is not None
        return p.status

    def close(self) -> None:
        self._closing = True
        self._call.cancel()  # type: ignore[no-untyped-call]
        self._thread.join(5)


class ReleaseWatcher:
    """The prefill engine's ``WatchReleases`` stream: which held requests were let go, why."""

    def __init__(self, client: DaemonClient) -> None:
        self._client = client
        self._cond = threading.Condition()
        self.released: dict[str, int] = {}
        self.released_at: dict[str, float] = {}  # time.perf_counter() when the stream said so
        self.error = ""
        self._closing = False
        engine = client.engine
        if engine is None:
            raise RpcFailure(
                "WatchReleases",
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{client.name} has no engine socket",
                None,
            )
        self._call = engine.WatchReleases(
            engine_pb2.WatchReleasesRequest(), metadata=client.metadata
        )
        self._call.initial_metadata()  # the watch is registered: no release can slip by
        self._thread = threading.Thread(
            target=self._run, name=f"releases-{client.name}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            for resp in self._call:
                with self._cond:
                    self.released[resp.request_id] = resp.reason
                    self.released_at[resp.request_id] = time.perf_counter()
                    self._cond.notify_all()
            if not self._closing:
                self.error = "the WatchReleases stream ended"
        except grpc.RpcError as exc:
            if not self._closing:
                self.error = str(rpc_failure(f"{self._client.name} WatchReleases", exc))
        with self._cond:
            self._cond.notify_all()

    def wait(self, request_ids: Sequence[str], timeout_s: float) -> set[str]:
        """Wait until every one of ``request_ids`` was released; return those that were not."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                missing = {r for r in request_ids if r not in self.released}
                left = deadline - time.monotonic()
                if not missing or left <= 0 or self.error:
                    return missing
                self._cond.wait(left)

    def reason(self, request_id: str) -> str:
        with self._cond:
            r = self.released.get(request_id)
        if r is None:
            return ""
        return common_pb2.ReleaseReason.Name(r).removeprefix("RELEASE_REASON_")  # type: ignore[arg-type]

    def close(self) -> None:
        self._closing = True
        self._call.cancel()  # type: ignore[no-untyped-call]
        self._thread.join(5)
