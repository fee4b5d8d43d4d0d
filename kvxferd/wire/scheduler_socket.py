"""The Scheduler's unary calls over the decode daemon's scheduler socket (blocking).

A caller on the daemon's host (a scheduler, or the vLLM connector in the engine beside it) can
send StartPull, GetTransfer, CancelTransfer, DeclinePull and ListPeers as frames on the Unix
socket the daemon serves at ``server.scheduler_socket`` (:mod:`kvxferd.wire.local`) instead of
over gRPC: the same messages, the same handlers, the same errors, without a gRPC round trip's
Python and HTTP/2 work on either side. :class:`SchedulerSocket` looks like the generated stub's
unary methods (``StartPull(request, timeout=..., metadata=...)``), so
:class:`~kvxferd.client.sync_client.SchedulerClient` takes it in the stub's place; a failed call
raises :class:`~kvxferd.wire.peer_client.RpcFailure`, a ``grpc.RpcError`` with the code,
details and error trailer the gRPC port would have sent.

One connection, opened on first use and again after it breaks; calls are serialized on it (a
lock), so one :class:`SchedulerSocket` serves a thread at a time. :class:`SchedulerSockets`
keeps idle ones for callers whose threads each wait on a pull (the vLLM connector).
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from typing import Any

import grpc

from kvxferd.wire.local import (
    ANSWER,
    SCHEDULER_METHODS,
    LocalTransport,
    answer_message,
    request_frame,
)
from kvxferd.wire.peer_client import Metadata, RpcFailure
from kvxferd.wire.splitter import HEADER, MAX_FRAME

# How far past an answer's header the first read may take (the answer's body: a StartPull's
# terminal status is a few hundred bytes).
READ_AHEAD = 64 << 10


class SchedulerSocket:
    """Blocking calls to the Scheduler methods a daemon serves on its socket at ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connect(self) -> socket.socket:
        if self._sock is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.path)
            except OSError as exc:
                s.close()
                raise RpcFailure(
                    grpc.StatusCode.UNAVAILABLE,
                    f"cannot connect to the scheduler socket {self.path}: {exc}; check that the"
                    " daemon runs with server.scheduler_socket set to this path",
                    (),
                ) from exc
            self._sock = s
        return self._sock

    def call(self, method: str, request: Any, *, timeout: float, metadata: Metadata = ()) -> Any:
        """One call; its answer message, or :class:`RpcFailure`."""
        types = SCHEDULER_METHODS.get(method)
        if types is None:
            raise RpcFailure(
                grpc.StatusCode.UNIMPLEMENTED,
                f"{method} is not served on the scheduler socket; call it over gRPC",
                (),
            )
        deadline = time.monotonic() + timeout
        with self._lock:
            call_id = next(self._ids) & 0xFFFFFFFF
            data = request_frame(call_id, method, metadata, timeout, request)
            for attempt in (1, 2):
                sock = self._connect()
                try:
                    sock.sendall(data)
                    break
                except OSError as exc:  # a connection the daemon closed: open a new one once
                    self._drop()
                    if attempt == 2:
                        raise RpcFailure(
                            grpc.StatusCode.UNAVAILABLE,
                            f"the scheduler socket {self.path} broke: {exc}",
                            (),
                        ) from exc
            body = self._answer(sock, call_id, deadline)
        return answer_message(body, types[1])

    def _answer(self, sock: socket.socket, call_id: int, deadline: float) -> bytes:
        """The body of ``call_id``'s answer, the next frame on the connection (calls on it are
        serialized, and one that timed out closed it); DEADLINE_EXCEEDED when it does not come
        in time."""
        try:
            # One read takes the header and what has come of the body (usually all of it).
            first = self._read(sock, HEADER.size, deadline, more=READ_AHEAD)
            size, got, kind = HEADER.unpack_from(first)
            if size > MAX_FRAME or kind != ANSWER or got != call_id:
                raise OSError(f"an unexpected frame (kind {kind}, call {got}, {size} bytes)")
            body = first[HEADER.size :]
            if len(body) > size:  # nothing follows an answer until the next request
                raise OSError(f"{len(body) - size} bytes past the answer's frame")
            if len(body) < size:
                body += self._read(sock, size - len(body), deadline)
            return body
        except TimeoutError:
            # Closing the connection ends the call on the daemon (a pull it started goes on,
            # as when a gRPC caller gives up) and drops any part of a frame read so far.
            self._drop()
            raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", ()) from None
        except OSError as exc:
            self._drop()
            raise RpcFailure(
                grpc.StatusCode.UNAVAILABLE,
                f"the scheduler socket {self.path} broke during the call: {exc}",
                (),
            ) from exc

    def _read(self, sock: socket.socket, n: int, deadline: float, more: int = 0) -> bytes:
        """At least ``n`` bytes (at most ``n + more``: whatever has arrived of them)."""
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            chunk = sock.recv(n + more - len(buf))
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            buf += chunk
        return bytes(buf)

    # The generated stub's unary methods, for SchedulerClient.
    def StartPull(self, request: Any, *, timeout: float, metadata: Metadata = ()) -> Any:  # noqa: N802
        return self.call("StartPull", request, timeout=timeout, metadata=metadata)

    def GetTransfer(self, request: Any, *, timeout: float, metadata: Metadata = ()) -> Any:  # noqa: N802
        return self.call("GetTransfer", request, timeout=timeout, metadata=metadata)

    def CancelTransfer(self, request: Any, *, timeout: float, metadata: Metadata = ()) -> Any:  # noqa: N802
        return self.call("CancelTransfer", request, timeout=timeout, metadata=metadata)

    def DeclinePull(self, request: Any, *, timeout: float, metadata: Metadata = ()) -> Any:  # noqa: N802
        return self.call("DeclinePull", request, timeout=timeout, metadata=metadata)

    def ListPeers(self, request: Any, *, timeout: float, metadata: Metadata = ()) -> Any:  # noqa: N802
        return self.call("ListPeers", request, timeout=timeout, metadata=metadata)


class SchedulerSockets:
    """Idle :class:`SchedulerSocket` connections to one path: :meth:`call` takes one (or opens
    one) for the call and keeps it for the next unless the call failed, so concurrent callers
    never wait on each other's pulls."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._idle: list[SchedulerSocket] = []
        self._lock = threading.Lock()

    def call(self, method: str, request: Any, *, timeout: float, metadata: Metadata = ()) -> Any:
        with self._lock:
            sock = self._idle.pop() if self._idle else SchedulerSocket(self.path)
        try:
            answer = sock.call(method, request, timeout=timeout, metadata=metadata)
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self._idle.append(sock)
        return answer

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


class AsyncSchedulerSocket:
    """The same calls for asyncio (:class:`~kvxferd.client.async_client.AsyncSchedulerClient`):
    one connection multiplexing concurrent calls by ID (:class:`kvxferd.wire.local.LocalTransport`
    with the Scheduler's methods), the generated aio stub's unary methods' shape."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._transport = LocalTransport(path, SCHEDULER_METHODS)

    async def close(self) -> None:
        await self._transport.close()

    async def _call(self, method: str, request: Any, timeout: float, metadata: Metadata) -> Any:
        return await self._transport(method, request, timeout=timeout, metadata=metadata)

    async def StartPull(self, request: Any, *, timeout: float, metadata: Metadata = ()) -> Any:  # noqa: N802
        return await self._call("StartPull", request, timeout, metadata)

    async def GetTransfer(self, request: Any, *, timeout: float, metadata: Metadata = ()) -> Any:  # noqa: N802
        return await self._call("GetTransfer", request, timeout, metadata)

    async def CancelTransfer(self, request: Any, *, timeout: float, metadata: Metadata = ()) -> Any:  # noqa: N802
        return await self._call("CancelTransfer", request, timeout, metadata)

    async def DeclinePull(self, request: Any, *, timeout: float, metadata: Metadata = ()) -> Any:  # noqa: N802
        return await self._call("DeclinePull", request, timeout, metadata)

    async def ListPeers(self, request: Any, *, timeout: float, metadata: Metadata = ()) -> Any:  # noqa: N802
        return await self._call("ListPeers", request, timeout, metadata)


__all__ = ["AsyncSchedulerSocket", "SchedulerSocket", "SchedulerSockets"]
