"""The daemon's Unix sockets of framed calls: the owner's same-host Peer socket (the Peer calls of
a pull's lifetime) and, when configured, the scheduler socket (the Scheduler's unary calls).

Answers the calls :data:`kvxferd.wire.peer_client.LOCAL_METHODS` names with the very
:class:`~kvxferd.service.peer_service.PeerService` handlers gRPC uses, through a small context
that plays the part of gRPC's (metadata, deadline, abort with a trailer), so a call behaves
the same on either path: the same session check, the same errors with the same trailers, the
same ``kvxferd_rpcs_total`` and ``kvxferd_rpc_duration_seconds`` series. Frames and why:
:mod:`kvxferd.wire.local`.

Who can call: the socket file is created mode 0600 (the daemon's user only), the bearer token
is checked as on gRPC when ``auth.token`` is set, and every call acts for a handshake
session, which only a gRPC Handshake grants. A malformed frame closes that one
connection; a call the socket does not serve is answered UNIMPLEMENTED; neither touches memory.

The scheduler socket (``server.scheduler_socket``, off by default) answers
:data:`kvxferd.wire.local.SCHEDULER_METHODS` with the very
:class:`~kvxferd.service.scheduler_service.SchedulerService` handlers, the same way: mode 0660
like the Engine socket (the caller may run as another user of the daemon's group), the token
checked when set.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import socket
import stat
import tempfile
import time
from collections.abc import Sequence
from typing import Any, cast

import grpc
from grpc import aio

from kvxferd.logs import kv
from kvxferd.metrics import Metrics
from kvxferd.metrics.rpc import observe_served
from kvxferd.service.auth import token_refusal
from kvxferd.tasks import start_now
from kvxferd.wire.errors import message_for
from kvxferd.wire.local import (
    CANCEL,
    METHODS,
    REQUEST,
    FrameError,
    FrameSplitter,
    answer_frame,
    parse_request,
)

log = logging.getLogger(__name__)

SERVICE = "kvxferd.v1.Peer"
SCHEDULER = "kvxferd.v1.Scheduler"
MAX_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
FRAME_FIX = (
    "frame calls as kvxferd/wire/local.py describes, as kvxferd.wire.scheduler_socket and"
    " kvxferd.client do"
)


def socket_path(setting: str, instance_id: str) -> str:
    """Where to serve: ``""`` for ``peers.local_socket = "off"``, a path in the temporary
    directory named after this instance for ``"auto"``, else the configured path."""
    if setting == "off":
        return ""
    if setting == "auto":
        return os.path.join(tempfile.gettempdir(), f"kvxferd-peer-{instance_id[:16]}.sock")
    return setting


def sweep_stale(directory: str, only: str = "") -> list[str]:
    """Remove the ``auto`` sockets (or just ``only``) of daemons that died without cleaning up
    (nobody accepts on them any more); returns what was removed. A socket that accepts is
    left alone."""
    removed = []
    names = [os.path.basename(only)] if only else sorted(os.listdir(directory))
    for name in names:
        if not only and not (name.startswith("kvxferd-peer-") and name.endswith(".sock")):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                continue
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                os.unlink(path)
                removed.append(path)
    return removed


class _Abort(aio.AbortError):  # what handlers' aborts raise, as on gRPC (rpc() lets it pass)
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class LocalContext:
    """The part of ``grpc.aio.ServicerContext`` the Peer handlers use."""

    def __init__(
        self, metadata: Sequence[tuple[str, str | bytes]], peer: str, deadline: float
    ) -> None:
        self._metadata = tuple(metadata)
        self._peer = peer
        self._deadline = deadline
        self.trailer: tuple[tuple[str, str | bytes], ...] = ()

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def set_trailing_metadata(self, trailer: Sequence[tuple[str, str | bytes]]) -> None:
        self.trailer = tuple(trailer)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Abort(code, details)

    def code(self) -> None:
        return None


def _forget(calls: dict[int, asyncio.Task[None]], call_id: int, _: object) -> None:
    calls.pop(call_id, None)


# Answers a connection may leave unread before it stops being read: past this many bytes
# waiting in its write buffer, the frames already read wait unstarted and reading pauses until
# the caller has taken most of its answers (asyncio's flow control: pause_writing and
# resume_writing). A caller that sends requests and never reads the answers thus holds at most
# this much of the daemon's memory (plus one read of frames and the answers of calls running),
# however many it sends.
WRITE_HIGH_WATER = 4 << 20


class _Calls(asyncio.Protocol):
    """One connection to a :class:`LocalPeerServer`: each REQUEST frame starts its call as the
    bytes arrive (:func:`kvxferd.tasks.start_now`: a handler that answers without waiting has
    written its answer before this returns), a CANCEL frame cancels that call, and a malformed
    frame (or a REQUEST reusing the ID of a call still running) closes the connection,
    cancelling its calls. While the connection's unread answers exceed
    :data:`WRITE_HIGH_WATER`, frames wait in order and nothing more is read."""

    def __init__(self, server: LocalPeerServer) -> None:
        self._server = server
        self._frames = FrameSplitter()
        self._calls: dict[int, asyncio.Task[None]] = {}
        self._held: collections.deque[tuple[int, int, bytes]] = collections.deque()
        self._backed_up = False
        self.transport: asyncio.Transport | None = None
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self._server._conns.add(self)

    def pause_writing(self) -> None:
        # Called by the transport from inside a write: the frames after this one wait.
        self._backed_up = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._backed_up = False
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.resume_reading()
        try:
            while self._held and not self._backed_up:
                self._frame(*self._held.popleft())
        except FrameError as exc:
            self._refuse(exc)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        try:
            for call_id, kind, body in self._frames.feed(data):
                if self._backed_up or self._held:
                    self._held.append((call_id, kind, body))
                else:
                    self._frame(call_id, kind, body)
        except FrameError as exc:
            self._refuse(exc)

    def _frame(self, call_id: int, kind: int, body: bytes) -> None:
        assert self.transport is not None
        if kind == REQUEST:
            if call_id in self._calls:
                raise FrameError(f"call ID {call_id} is already in use by a running call")
            call = start_now(self._server._serve(call_id, body, self.transport))
            if not call.done():
                self._calls[call_id] = call
                call.add_done_callback(functools.partial(_forget, self._calls, call_id))
        elif kind == CANCEL:
            running = self._calls.pop(call_id, None)
            if running is not None:
                running.cancel()
        else:
            raise FrameError(f"unexpected frame kind {kind}")

    def _refuse(self, exc: FrameError) -> None:
        log.warning(
            "closing a local socket connection",
            extra=kv(why=str(exc), service=self._server.name),
        )
        self._held.clear()
        self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server._conns.discard(self)
        self._held.clear()
        for call in self._calls.values():
            call.cancel()
        self._calls.clear()
        if not self.lost.done():
            self.lost.set_result(None)


class LocalPeerServer:
    """Serves ``service``'s ``methods`` (the Peer's :data:`~kvxferd.wire.local.METHODS` unless
    told) on a Unix socket at ``path``, created with ``mode``; ``name``: the service's full
    name, for metrics and messages."""

    def __init__(
        self,
        service: Any,
        metrics: Metrics,
        path: str,
        token: str = "",
        *,
        name: str = SERVICE,
        methods: dict[str, tuple[type[Any], type[Any]]] = METHODS,
        mode: int = 0o600,
    ) -> None:
        if len(path.encode()) > MAX_PATH:
            raise ValueError(f"the socket path is over {MAX_PATH} bytes: {path}")
        self.path = path
        self.name, self._methods, self._mode = name, methods, mode
        self._service = service
        self._m = metrics
        self._expected = f"Bearer {token}".encode() if token else b""
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[_Calls] = set()

    async def start(self) -> None:
        """Serve; a socket left at the path by a dead daemon is replaced, one that still
        accepts (another daemon serves there) is an OSError."""
        if os.path.lexists(self.path):
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise OSError(f"{self.path} exists and is not a socket")
            if self.path not in sweep_stale(os.path.dirname(self.path) or ".", only=self.path):
                raise OSError(f"another process serves on {self.path}")
        old = os.umask(0o777 & ~self._mode)
        try:
            loop = asyncio.get_running_loop()
            self._server = await loop.create_unix_server(lambda: _Calls(self), self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, self._mode)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            conns = list(self._conns)
            for conn in conns:
                conn.close()
            if conns:  # their connection_lost cancels every call left on them
                await asyncio.wait([c.lost for c in conns], timeout=5)
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    async def _serve(self, call_id: int, body: bytes, transport: asyncio.Transport) -> None:
        t0 = time.perf_counter()
        try:
            method, code, frame = await self._answer(call_id, body)
        except asyncio.CancelledError:
            return  # the caller gave up (or we are closing): nothing to answer
        except Exception as exc:  # a bug outside the handlers: still an answer, and logged
            log.exception("local socket call failed", extra=kv(service=self.name))
            method, code = "unknown", grpc.StatusCode.INTERNAL
            frame = answer_frame(call_id, code, message_for(exc))
        if not transport.is_closing():
            transport.write(frame)  # the caller's answer first, then our books
        observe_served(self._m, self.name, method, code.name, t0)

    async def _answer(self, call_id: int, body: bytes) -> tuple[str, grpc.StatusCode, bytes]:
        try:
            method, meta, timeout_s, raw = parse_request(body)
        except FrameError as exc:
            code = grpc.StatusCode.INVALID_ARGUMENT
            text = f"malformed request: {exc} (fix: {FRAME_FIX})"
            return "unknown", code, answer_frame(call_id, code, text)
        types = self._methods.get(method)
        if types is None:
            code = grpc.StatusCode.UNIMPLEMENTED
            text = (
                f"{method!r} is not served on this {self.name} socket ({self.path}); it serves"
                f" {', '.join(sorted(self._methods))}; call the others on the gRPC port"
            )
            return "unknown", code, answer_frame(call_id, code, text)
        if self._expected:
            refusal = token_refusal(meta, self._expected, f"/{self.name}/{method}")
            if refusal is not None:
                code = grpc.StatusCode.UNAUTHENTICATED
                return method, code, answer_frame(call_id, code, refusal)
        request = types[0]()
        try:
            request.ParseFromString(raw)
        except Exception:  # protobuf's DecodeError
            code = grpc.StatusCode.INVALID_ARGUMENT
            text = (
                f"the {method} request does not decode as {types[0].__name__}"
                f" (fix: send that message, serialized; {FRAME_FIX})"
            )
            return method, code, answer_frame(call_id, code, text)
        ctx = LocalContext(meta, f"unix:{self.path}", time.monotonic() + timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                answer = await getattr(self._service, method)(request, ctx)
        except _Abort as ab:
            return method, ab.code, answer_frame(call_id, ab.code, ab.details, ctx.trailer)
        except TimeoutError:
            code = grpc.StatusCode.DEADLINE_EXCEEDED
            return method, code, answer_frame(call_id, code, "Deadline Exceeded")
        except Exception as exc:  # the handlers answer errors through abort; this is a bug
            log.exception("local socket call failed", extra=kv(method=method, service=self.name))
            code = grpc.StatusCode.INTERNAL
            return method, code, answer_frame(call_id, code, f"{type(exc).__name__}: {exc}")
        return (
            method,
            grpc.StatusCode.OK,
            answer_frame(call_id, grpc.StatusCode.OK, answer=answer.SerializeToString()),
        )
