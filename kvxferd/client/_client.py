"""The Scheduler client: typed values, one error type, retries through gRPC's service config.

Imports only grpc, protobuf and the generated ``kvxferd.v1`` modules.
"""

from __future__ import annotations

import enum
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from types import TracebackType
from typing import Any, Self

import grpc
from grpc import aio

from kvxferd.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

ERROR_TRAILER = "kvxferd-error-bin"
MAX_MESSAGE_BYTES = 64 << 20
_SCHEDULER = "kvxferd.v1.Scheduler"

SERVICE_CONFIG: dict[str, Any] = {
    "methodConfig": [
        {
            # Idempotent calls (StartPull: through its transfer_id, set by this client).
            "name": [
                {"service": _SCHEDULER, "method": m}
                for m in (
                    "StartPull",
                    "GetTransfer",
                    "CancelTransfer",
                    "ListPeers",
                    "Checksum",
                    "WatchTransfers",
                )
            ],
            "retryPolicy": {
                "maxAttempts": 4,
                "initialBackoff": "0.1s",
                "maxBackoff": "2s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
}
"""gRPC service config of the client's channels: up to 4 attempts on UNAVAILABLE (daemon
restarting, connection reset), 0.1 s backoff doubling up to 2 s. A streaming call is retried
only until its first message arrives (gRPC's rule)."""


def proto_dir() -> Traversable:
    """The folder of the ``.proto`` files of ``kvxferd.v1`` shipped in the package (import
    path root: ``kvxferd/v1/scheduler.proto`` etc. lie under it)."""
    return resources.files("kvxferd") / "proto"


def proto_files() -> dict[str, str]:
    """Every shipped ``.proto`` file: import path (``kvxferd/v1/scheduler.proto``) -> text."""
    base = proto_dir() / "kvxferd" / "v1"
    return {
        f"kvxferd/v1/{p.name}": p.read_text(encoding="utf-8")
        for p in sorted(base.iterdir(), key=lambda t: t.name)
        if p.name.endswith(".proto")
    }


# --- values ---------------------------------------------------------------------------------


class TransferState(enum.Enum):
    UNSPECIFIED = 0
    PENDING = 1
    HANDSHAKING = 2
    CONFIRMING = 3
    TRANSFERRING = 4
    DONE = 5
    FAILED = 6
    CANCELLED = 7
    EXPIRED = 8

    @property
    def terminal(self) -> bool:
        return self in (
            TransferState.DONE,
            TransferState.FAILED,
            TransferState.CANCELLED,
            TransferState.EXPIRED,
        )

    @classmethod
    def of(cls, value: int) -> TransferState:
        try:
            return cls(value)
        except ValueError:
            return cls.UNSPECIFIED


class TransferStrategy(enum.Enum):
    UNSPECIFIED = 0
    DIRECT = 1
    STAGED = 2
    KERNEL = 3

    @classmethod
    def of(cls, value: int) -> TransferStrategy:
        try:
            return cls(value)
        except ValueError:
            return cls.UNSPECIFIED


class PeerState(enum.Enum):
    UNSPECIFIED = 0
    CONNECTING = 1
    READY = 2
    REFUSED = 3
    UNREACHABLE = 4
    STALE = 5

    @classmethod
    def of(cls, value: int) -> PeerState:
        try:
            return cls(value)
        except ValueError:
            return cls.UNSPECIFIED


class ChecksumAlgorithm(enum.Enum):
    UNSPECIFIED = 0
    BLAKE2B_64 = 1
    XXH64 = 2
    SHA256 = 3


@dataclass(frozen=True)
class Mismatch:
    what: str
    local: str
    remote: str
    fix: str


@dataclass(frozen=True)
class ErrorInfo:
    """The daemon's typed error (``common.proto`` ``ErrorDetail``)."""

    kind: str  # ErrorKind name without its prefix, e.g. "INCOMPATIBLE_PEER"
    message: str
    field: str = ""
    fix: str = ""
    mismatches: tuple[Mismatch, ...] = ()

    @classmethod
    def from_proto(cls, msg: common_pb2.ErrorDetail) -> ErrorInfo:
        try:
            kind = common_pb2.ErrorKind.Name(msg.kind).removeprefix("ERROR_KIND_")
        except ValueError:
            kind = str(msg.kind)
        return cls(
            kind=kind,
            message=msg.message,
            field=msg.field,
            fix=msg.fix,
            mismatches=tuple(Mismatch(m.what, m.local, m.remote, m.fix) for m in msg.mismatches),
        )

    def __str__(self) -> str:
        text = self.message
        if self.fix:
            text += f" (fix: {self.fix})"
        return text


def _groups(msg: common_pb2.GroupBlockIds) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(g.ids) for g in msg.groups)


@dataclass(frozen=True)
class TransferStatus:
    """One pull's status (``scheduler.proto`` ``TransferStatus``)."""

    transfer_id: str
    request_id: str
    peer_address: str
    state: TransferState
    nbytes: int
    strategy: TransferStrategy
    strategy_reason: str
    error: ErrorInfo | None
    invalid_local_block_ids: tuple[tuple[int, ...], ...]
    descriptors_before_coalescing: int
    descriptors_after_coalescing: int
    created_unix_ns: int
    started_unix_ns: int
    finished_unix_ns: int
    deadline_unix_ns: int
    revision: int
    stages: tuple[tuple[str, float], ...] = ()
    raw: scheduler_pb2.TransferStatus = field(
        default_factory=scheduler_pb2.TransferStatus, repr=False, compare=False
    )

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    @classmethod
    def from_proto(cls, msg: scheduler_pb2.TransferStatus) -> TransferStatus:
        return cls(
            transfer_id=msg.transfer_id,
            request_id=msg.request_id,
            peer_address=msg.peer_address,
            state=TransferState.of(msg.state),
            nbytes=msg.nbytes,
            strategy=TransferStrategy.of(msg.strategy),
            strategy_reason=msg.strategy_reason,
            error=ErrorInfo.from_proto(msg.error) if msg.HasField("error") else None,
            invalid_local_block_ids=_groups(msg.invalid_local_block_ids),
            descriptors_before_coalescing=msg.descriptors_before_coalescing,
            descriptors_after_coalescing=msg.descriptors_after_coalescing,
            created_unix_ns=msg.created_unix_ns,
            started_unix_ns=msg.started_unix_ns,
            finished_unix_ns=msg.finished_unix_ns,
            deadline_unix_ns=msg.deadline_unix_ns,
            revision=msg.revision,
            stages=tuple((s.name, s.seconds) for s in msg.stages),
            raw=msg,
        )


@dataclass(frozen=True)
class StartedPull:
    status: TransferStatus
    created: bool  # False: a pull with this transfer_id already existed (a retry)


@dataclass(frozen=True)
class PeerStatus:
    """A peer this daemon knows (``scheduler.proto`` ``PeerInfo``)."""

    address: str
    state: PeerState
    nixl_agent_name: str
    daemon_id: str
    instance_id: str
    registration_generation: int
    active_transfers: int
    last_error: ErrorInfo | None
    last_heartbeat_unix_ns: int
    last_handshake_unix_ns: int

    @classmethod
    def from_proto(cls, msg: scheduler_pb2.PeerInfo) -> PeerStatus:
        return cls(
            address=msg.address,
            state=PeerState.of(msg.handshake_state),
            nixl_agent_name=msg.nixl_agent_name,
            daemon_id=msg.daemon_id,
            instance_id=msg.instance_id,
            registration_generation=msg.registration_generation,
            active_transfers=msg.active_transfers,
            last_error=ErrorInfo.from_proto(msg.last_error) if msg.HasField("last_error") else None,
            last_heartbeat_unix_ns=msg.last_heartbeat_unix_ns,
            last_handshake_unix_ns=msg.last_handshake_unix_ns,
        )


class KvxferdRpcError(Exception):
    """A failed call: its gRPC status code, message and, when sent, the daemon's error."""

    def __init__(
        self, method: str, code: grpc.StatusCode, details: str, error: ErrorInfo | None
    ) -> None:
        self.method = method
        self.code = code
        self.details = details
        self.error = error
        super().__init__(f"{method}: {code.name}: {details}")

    @classmethod
    def wrap(cls, method: str, exc: grpc.RpcError) -> KvxferdRpcError:
        code = exc.code() if isinstance(exc, grpc.Call | aio.AioRpcError) else None
        details = exc.details() if isinstance(exc, grpc.Call | aio.AioRpcError) else str(exc)
        trailer: Any = ()
        if isinstance(exc, grpc.Call | aio.AioRpcError):
            trailer = exc.trailing_metadata() or ()
        error = None
        for key, value in trailer:
            if key == ERROR_TRAILER and isinstance(value, bytes):
                try:
                    error = ErrorInfo.from_proto(common_pb2.ErrorDetail.FromString(value))
                except Exception:
                    error = None
        return cls(method, code or grpc.StatusCode.UNKNOWN, details or "", error)


# --- requests -------------------------------------------------------------------------------

BlockIds = Sequence[Sequence[int]] | common_pb2.GroupBlockIds


def _block_ids(ids: BlockIds, what: str) -> common_pb2.GroupBlockIds:
    if isinstance(ids, common_pb2.GroupBlockIds):
        return ids
    if isinstance(ids, str | bytes) or not all(
        isinstance(g, Sequence | Iterable) and not isinstance(g, str | bytes) for g in ids
    ):
        raise TypeError(f"{what}: one sequence of block IDs per KV cache group, e.g. [[1, 2, 3]]")
    return common_pb2.GroupBlockIds(groups=[common_pb2.BlockIds(ids=list(g)) for g in ids])


def _start_request(
    *,
    request_id: str,
    peer_address: str,
    remote_block_ids: BlockIds,
    local_block_ids: BlockIds,
    transfer_id: str,
    deadline_ms: int,
    skip_notify: bool,
) -> scheduler_pb2.StartPullRequest:
    return scheduler_pb2.StartPullRequest(
        transfer_id=transfer_id or uuid.uuid4().hex,
        request_id=request_id,
        peer_address=peer_address,
        remote_block_ids=_block_ids(remote_block_ids, "remote_block_ids"),
        local_block_ids=_block_ids(local_block_ids, "local_block_ids"),
        deadline_ms=deadline_ms,
        options=scheduler_pb2.PullOptions(skip_notify=skip_notify),
    )


def _options(retry: bool, extra: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    opts: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.enable_retries", 1 if retry else 0),
    ]
    if retry:
        opts.append(("grpc.service_config", json.dumps(SERVICE_CONFIG)))
    return [*opts, *extra]


def _metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


# --- sync -----------------------------------------------------------------------------------


class SchedulerClient:
    """A daemon's Scheduler service over a blocking gRPC channel.

    ``target``: the daemon's ``server.listen``/``server.advertise`` address. ``token``: its
    ``auth.token``. ``credentials``: TLS (``grpc.ssl_channel_credentials``) when the daemon
    has ``auth.tls_cert``. ``timeout_s``: per call (streams: none)."""

    def __init__(
        self,
        target: str,
        *,
        token: str = "",
        credentials: grpc.ChannelCredentials | None = None,
        timeout_s: float = 30.0,
        retry: bool = True,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        opts = _options(retry, options)
        self._channel = (
            grpc.secure_channel(target, credentials, options=opts)
            if credentials is not None
            else grpc.insecure_channel(target, options=opts)
        )
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._md = _metadata(token)
        self.timeout_s = timeout_s

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def start_pull(
        self,
        *,
        request_id: str,
        peer_address: str,
        remote_block_ids: BlockIds,
        local_block_ids: BlockIds,
        transfer_id: str = "",
        deadline_ms: int = 0,
        skip_notify: bool = False,
    ) -> StartedPull:
        """Start pulling ``remote_block_ids`` (logical block IDs per group, as the prefill
        engine's ``Hold`` returned them) from ``peer_address`` into ``local_block_ids``.
        Returns at once; follow the pull with :meth:`wait` or :meth:`watch_transfers`."""
        req = _start_request(
            request_id=request_id,
            peer_address=peer_address,
            remote_block_ids=remote_block_ids,
            local_block_ids=local_block_ids,
            transfer_id=transfer_id,
            deadline_ms=deadline_ms,
            skip_notify=skip_notify,
        )
        try:
            resp = self._stub.StartPull(req, timeout=self.timeout_s, metadata=self._md)
        except grpc.RpcError as exc:
            raise KvxferdRpcError.wrap("StartPull", exc) from exc
        return StartedPull(TransferStatus.from_proto(resp.status), resp.created)

    def get_transfer(self, transfer_id: str) -> TransferStatus:
        try:
            resp = self._stub.GetTransfer(
                scheduler_pb2.GetTransferRequest(transfer_id=transfer_id),
                timeout=self.timeout_s,
                metadata=self._md,
            )
        except grpc.RpcError as exc:
            raise KvxferdRpcError.wrap("GetTransfer", exc) from exc
        return TransferStatus.from_proto(resp.status)

    def cancel_transfer(self, transfer_id: str) -> TransferStatus:
        """Cancel a pull; returns its terminal status (DONE if it completed first)."""
        try:
            resp = self._stub.CancelTransfer(
                scheduler_pb2.CancelTransferRequest(transfer_id=transfer_id),
                timeout=self.timeout_s,
                metadata=self._md,
            )
        except grpc.RpcError as exc:
            raise KvxferdRpcError.wrap("CancelTransfer", exc) from exc
        return TransferStatus.from_proto(resp.status)

    def watch_transfers(self, transfer_ids: Iterable[str] = ()) -> Iterator[TransferStatus]:
        """Every change of the named pulls (all pulls when none are named), after a snapshot;
        with names, the stream ends once every named pull is terminal."""
        call = self._stub.WatchTransfers(
            scheduler_pb2.WatchTransfersRequest(transfer_ids=list(transfer_ids)),
            metadata=self._md,
        )
        try:
            for msg in call:
                yield TransferStatus.from_proto(msg.status)
        except grpc.RpcError as exc:
            raise KvxferdRpcError.wrap("WatchTransfers", exc) from exc
        finally:
            call.cancel()  # type: ignore[no-untyped-call]

    def wait(self, transfer_id: str, timeout_s: float = 60.0) -> TransferStatus:
        """The pull's terminal status; TimeoutError if it is not terminal in ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        call = self._stub.WatchTransfers(
            scheduler_pb2.WatchTransfersRequest(transfer_ids=[transfer_id]),
            metadata=self._md,
            timeout=timeout_s,
        )
        try:
            for msg in call:
                status = TransferStatus.from_proto(msg.status)
                if status.terminal:
                    return status
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(f"{transfer_id} not terminal after {timeout_s} s") from exc
            raise KvxferdRpcError.wrap("WatchTransfers", exc) from exc
        finally:
            call.cancel()  # type: ignore[no-untyped-call]
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{transfer_id} not terminal after {timeout_s} s")
        return self.get_transfer(transfer_id)

    def list_peers(self) -> list[PeerStatus]:
        try:
            resp = self._stub.ListPeers(
                scheduler_pb2.ListPeersRequest(), timeout=self.timeout_s, metadata=self._md
            )
        except grpc.RpcError as exc:
            raise KvxferdRpcError.wrap("ListPeers", exc) from exc
        return [PeerStatus.from_proto(p) for p in resp.peers]

    def checksum(
        self,
        group_index: int,
        block_ids: Sequence[int],
        *,
        kernel_block_ids: bool = False,
        algorithm: ChecksumAlgorithm = ChecksumAlgorithm.UNSPECIFIED,
    ) -> list[bytes]:
        """Digests of blocks of one group (logical IDs, or kernel IDs with
        ``kernel_block_ids``): compare a pulled block with its source."""
        try:
            resp = self._stub.Checksum(
                scheduler_pb2.ChecksumRequest(
                    group_index=group_index,
                    block_ids=list(block_ids),
                    kernel_block_ids=kernel_block_ids,
                    algorithm=algorithm.value,  # type: ignore[arg-type]
                ),
                timeout=self.timeout_s,
                metadata=self._md,
            )
        except grpc.RpcError as exc:
            raise KvxferdRpcError.wrap("Checksum", exc) from exc
        return list(resp.digests)


# --- async ----------------------------------------------------------------------------------


class AsyncSchedulerClient:
    """:class:`SchedulerClient` for asyncio (``grpc.aio``); create it inside the loop."""

    def __init__(
        self,
        target: str,
        *,
        token: str = "",
        credentials: grpc.ChannelCredentials | None = None,
        timeout_s: float = 30.0,
        retry: bool = True,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        opts = _options(retry, options)
        self._channel = (
            aio.secure_channel(target, credentials, options=opts)
            if credentials is not None
            else aio.insecure_channel(target, options=opts)
        )
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._md = _metadata(token)
        self.timeout_s = timeout_s

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close(None)

    async def start_pull(
        self,
        *,
        request_id: str,
        peer_address: str,
        remote_block_ids: BlockIds,
        local_block_ids: BlockIds,
        transfer_id: str = "",
        deadline_ms: int = 0,
        skip_notify: bool = False,
    ) -> StartedPull:
        req = _start_request(
            request_id=request_id,
            peer_address=peer_address,
            remote_block_ids=remote_block_ids,
            local_block_ids=local_block_ids,
            transfer_id=transfer_id,
            deadline_ms=deadline_ms,
            skip_notify=skip_notify,
        )
        try:
            resp = await self._stub.StartPull(req, timeout=self.timeout_s, metadata=self._md)
        except aio.AioRpcError as exc:
            raise KvxferdRpcError.wrap("StartPull", exc) from exc
        return StartedPull(TransferStatus.from_proto(resp.status), resp.created)

    async def get_transfer(self, transfer_id: str) -> TransferStatus:
        try:
            resp = await self._stub.GetTransfer(
                scheduler_pb2.GetTransferRequest(transfer_id=transfer_id),
                timeout=self.timeout_s,
                metadata=self._md,
            )
        except aio.AioRpcError as exc:
            raise KvxferdRpcError.wrap("GetTransfer", exc) from exc
        return TransferStatus.from_proto(resp.status)

    async def cancel_transfer(self, transfer_id: str) -> TransferStatus:
        try:
            resp = await self._stub.CancelTransfer(
                scheduler_pb2.CancelTransferRequest(transfer_id=transfer_id),
                timeout=self.timeout_s,
                metadata=self._md,
            )
        except aio.AioRpcError as exc:
            raise KvxferdRpcError.wrap("CancelTransfer", exc) from exc
        return TransferStatus.from_proto(resp.status)

    async def watch_transfers(
        self, transfer_ids: Iterable[str] = ()
    ) -> AsyncIterator[TransferStatus]:
        call = self._stub.WatchTransfers(
            scheduler_pb2.WatchTransfersRequest(transfer_ids=list(transfer_ids)),
            metadata=self._md,
        )
        try:
            async for msg in call:
                yield TransferStatus.from_proto(msg.status)
        except aio.AioRpcError as exc:
            raise KvxferdRpcError.wrap("WatchTransfers", exc) from exc
        finally:
            call.cancel()

    async def wait(self, transfer_id: str, timeout_s: float = 60.0) -> TransferStatus:
        call = self._stub.WatchTransfers(
            scheduler_pb2.WatchTransfersRequest(transfer_ids=[transfer_id]),
            metadata=self._md,
            timeout=timeout_s,
        )
        try:
            async for msg in call:
                status = TransferStatus.from_proto(msg.status)
                if status.terminal:
                    return status
        except aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(f"{transfer_id} not terminal after {timeout_s} s") from exc
            raise KvxferdRpcError.wrap("WatchTransfers", exc) from exc
        finally:
            call.cancel()
        return await self.get_transfer(transfer_id)

    async def list_peers(self) -> list[PeerStatus]:
        try:
            resp = await self._stub.ListPeers(
                scheduler_pb2.ListPeersRequest(), timeout=self.timeout_s, metadata=self._md
            )
        except aio.AioRpcError as exc:
            raise KvxferdRpcError.wrap("ListPeers", exc) from exc
        return [PeerStatus.from_proto(p) for p in resp.peers]

    async def checksum(
        self,
        group_index: int,
        block_ids: Sequence[int],
        *,
        kernel_block_ids: bool = False,
        algorithm: ChecksumAlgorithm = ChecksumAlgorithm.UNSPECIFIED,
    ) -> list[bytes]:
        try:
            resp = await self._stub.Checksum(
                scheduler_pb2.ChecksumRequest(
                    group_index=group_index,
                    block_ids=list(block_ids),
                    kernel_block_ids=kernel_block_ids,
                    algorithm=algorithm.value,  # type: ignore[arg-type]
                ),
                timeout=self.timeout_s,
                metadata=self._md,
            )
        except aio.AioRpcError as exc:
            raise KvxferdRpcError.wrap("Checksum", exc) from exc
        return list(resp.digests)
