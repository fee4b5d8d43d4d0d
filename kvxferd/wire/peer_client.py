"""The typed client of one peer daemon's Peer service.

One place for what every Peer call needs: the credentials and the caller's session as
metadata, a timeout taken from the caller's remaining deadline (never more than the per-call
cap), and failures turned into :mod:`kvxferd.errors` exceptions through the one table in
:mod:`kvxferd.wire.errors`. A :class:`PeerClient` talks through a *transport*: the generated
gRPC stub of a channel (:class:`GrpcTransport`) or, in tests, :class:`FakeTransport`, which
calls a Python handler in process (like httpx's ``MockTransport``) so the pull lifecycle can be
exercised without sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc
from grpc import aio

from kvxferd.errors import DeadlineExceeded, KvxferdError, PeerUnavailable
from kvxferd.v1 import common_pb2, peer_pb2, peer_pb2_grpc
from kvxferd.wire.errors import error_from_rpc, status_for, trailer_for

SESSION_METADATA = "kvxferd-session"
# The Peer calls of a pull's lifetime, which a same-host owner also answers on its Unix socket
# (kvxferd.wire.local); Handshake and Push always go over gRPC.
LOCAL_METHODS = frozenset(
    {
        "ConfirmLease",
        "ExtendLease",
        "ReleaseLease",
        "DeclineLease",
        "Heartbeat",
        "Gather",
        "ReleaseStaging",
    }
)
Metadata = tuple[tuple[str, str], ...]
StageCall = aio.StreamStreamCall[peer_pb2.StageRequest, peer_pb2.StageResponse]
Resp = TypeVar("Resp")


class Transport(Protocol):
    """Sends one Peer call: ``method`` is the RPC name (``"ConfirmLease"``)."""

    async def __call__(
        self, method: str, request: Any, *, timeout: float, metadata: Metadata
    ) -> Any: ...

    async def close(self) -> None: ...


class GrpcTransport:
    """A transport over one gRPC channel (the generated stub); closing closes the channel."""

    def __init__(self, channel: aio.Channel) -> None:
        self._channel = channel
        self._stub = peer_pb2_grpc.PeerStub(channel)

    async def __call__(
        self, method: str, request: Any, *, timeout: float, metadata: Metadata
    ) -> Any:
        return await getattr(self._stub, method)(request, timeout=timeout, metadata=metadata)

    def stream(
        self, method: str, requests: AsyncIterator[Any], *, timeout: float, metadata: Metadata
    ) -> Any:
        """Open a bidi-streaming call (``Stage``): the call object, iterated for answers."""
        return getattr(self._stub, method)(requests, timeout=timeout, metadata=metadata)

    async def close(self) -> None:
        await self._channel.close(None)


class RpcFailure(grpc.RpcError):
    """A failed call shaped like gRPC's (code, details, trailing metadata): what
    :class:`FakeTransport` and the same-host transport (:mod:`kvxferd.wire.local`) raise."""

    def __init__(self, code: grpc.StatusCode, details: str, trailer: Any) -> None:
        super().__init__(details)
        self._code, self._details, self._trailer = code, details, trailer

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailer


class NotSent(RpcFailure):
    """The call never left: the transport could not reach the peer at all (no connection), so
    it is safe to send it another way."""


Handler = Callable[[str, Any, Metadata], Awaitable[Any]]


@dataclass
class FakeTransport:
    """An in-process transport: ``handler(method, request, metadata)`` answers each call or
    raises a :class:`KvxferdError`, which reaches the client exactly as a server's abort
    would (status code and error trailer). ``calls`` records ``(method, request)``."""

    handler: Handler
    calls: list[tuple[str, Any]] = field(default_factory=list)

    async def __call__(
        self, method: str, request: Any, *, timeout: float, metadata: Metadata
    ) -> Any:
        self.calls.append((method, request))
        if timeout <= 0:
            raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", ())
        try:  # a handler slower than the call's timeout times out, as over gRPC
            return await asyncio.wait_for(self.handler(method, request, metadata), timeout)
        except TimeoutError:
            raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", ()) from None
        except KvxferdError as err:
            raise RpcFailure(status_for(err), str(err), trailer_for(err)) from err

    async def close(self) -> None:
        return None


class PeerClient:
    """The Peer service at ``address``. ``credentials`` is the static call metadata (the
    bearer token); ``session`` is set from the handshake and sent on every later call."""

    def __init__(
        self,
        address: str,
        transport: Transport,
        *,
        credentials: Metadata = (),
        max_timeout_s: float = 5.0,
    ) -> None:
        self.address = address
        self.session = ""
        self.local: Transport | None = None  # the owner's same-host socket, once verified
        self._transport = transport
        self._credentials = credentials
        self._max_timeout_s = max_timeout_s

    async def close(self) -> None:
        await self.use_local(None)
        await self._transport.close()

    async def use_local(self, transport: Transport | None) -> None:
        """Send :data:`LOCAL_METHODS` through ``transport`` (None: back to gRPC)."""
        old, self.local = self.local, transport
        if old is not None and old is not transport:
            await old.close()

    def metadata(self) -> Metadata:
        if not self.session:
            return self._credentials
        return (*self._credentials, (SESSION_METADATA, self.session))

    async def _call(
        self,
        method: str,
        request: Any,
        what: str,
        time_left_s: float | None,
        *,
        capped: bool = True,
    ) -> Any:
        """``capped``: the call's timeout is at most the per-call cap; a call that lasts as long
        as a transfer (Push) passes False and gets all of ``time_left_s``."""
        timeout = (
            self._max_timeout_s
            if time_left_s is None
            else min(self._max_timeout_s, time_left_s)
            if capped
            else time_left_s
        )
        if timeout <= 0:
            raise DeadlineExceeded(
                f"no time left for {what} with {self.address}",
                fix="raise the pull's deadline_ms",
            )
        try:
            resp = await self._send(method, request, timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, what, self.address) from exc
        if resp is None:  # gRPC hands back None for an answer it could not decode
            raise PeerUnavailable(
                f"peer {self.address} answered {what} with an undecodable message",
                field="peer_address",
                fix="the peer is not a kvxferd daemon of this protocol version",
            )
        return resp

    async def _send(self, method: str, request: Any, timeout: float) -> Any:
        local = self.local if method in LOCAL_METHODS else None
        if local is not None:
            try:
                return await local(method, request, timeout=timeout, metadata=self.metadata())
            except NotSent:
                # The owner's socket is gone (it died or restarted): back to gRPC, where a new
                # instance answers with an unknown session and is handshaken again.
                await self.use_local(None)
        return await self._transport(method, request, timeout=timeout, metadata=self.metadata())

    async def handshake(
        self, version: int, digest: bytes, payload: bytes, time_left_s: float | None = None
    ) -> peer_pb2.HandshakeResponse:
        req = peer_pb2.HandshakeRequest(
            protocol_version=version, compat_digest=digest, payload=payload
        )
        resp: peer_pb2.HandshakeResponse = await self._call(
            "Handshake", req, "handshake", time_left_s
        )
        return resp

    async def confirm(
        self, request_id: str, reader_id: str, extend_ms: int, time_left_s: float | None
    ) -> peer_pb2.ConfirmLeaseResponse:
        req = peer_pb2.ConfirmLeaseRequest(
            request_id=request_id, reader_id=reader_id, extend_ms=extend_ms
        )
        resp: peer_pb2.ConfirmLeaseResponse = await self._call(
            "ConfirmLease", req, f"confirming the lease of {request_id!r}", time_left_s
        )
        return resp

    async def release(
        self, request_id: str, reader_id: str, *, done: bool, time_left_s: float | None = None
    ) -> peer_pb2.ReleaseLeaseResponse:
        reason = common_pb2.RELEASE_REASON_DONE if done else common_pb2.RELEASE_REASON_CANCELLED
        req = peer_pb2.ReleaseLeaseRequest(
            request_id=request_id, reader_id=reader_id, reason=reason
        )
        resp: peer_pb2.ReleaseLeaseResponse = await self._call(
            "ReleaseLease", req, f"releasing the lease of {request_id!r}", time_left_s
        )
        return resp

    async def decline(
        self, request_id: str, reader_id: str, time_left_s: float | None = None
    ) -> peer_pb2.DeclineLeaseResponse:
        req = peer_pb2.DeclineLeaseRequest(request_id=request_id, reader_id=reader_id)
        resp: peer_pb2.DeclineLeaseResponse = await self._call(
            "DeclineLease", req, f"declining the lease of {request_id!r}", time_left_s
        )
        return resp

    async def heartbeat(
        self, req: peer_pb2.HeartbeatRequest, time_left_s: float | None = None
    ) -> peer_pb2.HeartbeatResponse:
        resp: peer_pb2.HeartbeatResponse = await self._call(
            "Heartbeat", req, "heartbeat", time_left_s
        )
        return resp

    async def gather(
        self, req: peer_pb2.GatherRequest, what: str, time_left_s: float | None
    ) -> peer_pb2.GatherResponse:
        resp: peer_pb2.GatherResponse = await self._call("Gather", req, what, time_left_s)
        return resp

    async def release_staging(
        self, req: peer_pb2.ReleaseStagingRequest, time_left_s: float | None = None
    ) -> peer_pb2.ReleaseStagingResponse:
        resp: peer_pb2.ReleaseStagingResponse = await self._call(
            "ReleaseStaging", req, "releasing staging slots", time_left_s
        )
        return resp

    @property
    def can_stream(self) -> bool:
        """Whether this client's transport carries streams (gRPC does; the same-host socket
        and :class:`FakeTransport` carry unary calls only)."""
        return callable(getattr(self._transport, "stream", None))

    def stage(
        self, requests: AsyncIterator[peer_pb2.StageRequest], time_left_s: float
    ) -> StageCall:
        """Open a ``Stage`` stream (over gRPC) lasting up to ``time_left_s`` (the pull's whole
        remaining time, not capped): send through ``requests``, read with :meth:`events`;
        cancel the returned call to close it."""
        open_stream = getattr(self._transport, "stream", None)
        if open_stream is None:
            raise PeerUnavailable(
                f"the transport to {self.address} carries no streams",
                fix="read this peer with Gather (kvxferd.staging.reader) or over gRPC",
            )
        if time_left_s <= 0:
            raise DeadlineExceeded(
                f"no time left to stage a pull from {self.address}",
                fix="raise the pull's deadline_ms",
            )
        call: StageCall = open_stream(
            "Stage", requests, timeout=time_left_s, metadata=self.metadata()
        )
        return call

    async def events(self, call: StageCall, what: str) -> AsyncIterator[peer_pb2.StageResponse]:
        """``call``'s announcements; a failed stream raises the :mod:`kvxferd.errors` error."""
        try:
            async for event in call:
                yield event
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, what, self.address) from exc

    async def push(self, req: peer_pb2.PushRequest, time_left_s: float) -> peer_pb2.PushResponse:
        """Ask the owner to WRITE a held request into our blocks; answers once the WRITE
        completed, so the call may last up to ``time_left_s`` (not capped); cancelling it
        cancels the WRITE."""
        resp: peer_pb2.PushResponse = await self._call(
            "Push", req, f"pushing {req.request_id!r}", time_left_s, capped=False
        )
        return resp
