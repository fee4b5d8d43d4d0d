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
session, which only a gRPC Handshake grants. A frame over a limit is answered
RESOURCE_EXHAUSTED and passed over, one that breaks the format is answered INVALID_ARGUMENT
and closes that one connection, a call the socket does not serve is answered UNIMPLEMENTED:
none touches memory. Since the token is in the frame, a caller is known only once a frame has
come whole: what connections may make the daemon hold before that is capped per socket
(connections, frame size, unfinished big frames: :mod:`kvxferd.service.local_calls`).

The scheduler socket (``server.scheduler_socket``, off by default) answers
:data:`kvxferd.wire.local.SCHEDULER_METHODS` with the very
:class:`~kvxferd.service.scheduler_service.SchedulerService` handlers, the same way: mode 0660
like the Engine socket (the caller may run as another user of the daemon's group), the token
checked when set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import grpc
from grpc import aio

from kvxferd.logs import kv
from kvxferd.metrics import Metrics
from kvxferd.metrics.rpc import observe_served
from kvxferd.service.auth import token_refusal
from kvxferd.service.local_calls import FRAME_FIX, Calls
from kvxferd.wire.errors import message_for
from kvxferd.wire.local import METHODS, answer_frame, parse_request
from kvxferd.wire.splitter import MAX_FRAME, PENDING_LIMIT, FrameError, PendingBytes

log = logging.getLogger(__name__)

SERVICE = "kvxferd.v1.Peer"
SCHEDULER = "kvxferd.v1.Scheduler"
MAX_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
# Connections a socket serves at once, unless told: a same-host reader daemon keeps one to
# each owner, so a host's daemons need a few dozen. The scheduler socket's is sized from
# transfer.max_inflight (kvxferd/service/sockets.py): its blocking callers keep one per pull.
MAX_CONNECTIONS = 256
OVER_CAP_LOG_S = 60.0


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


class LocalPeerServer:
    """Serves ``service``'s ``methods`` (the Peer's :data:`~kvxferd.wire.local.METHODS` unless
    told) on a Unix socket at ``path``, created with ``mode``; ``name``: the service's full
    name, for metrics and messages. At most ``max_connections`` connections at once, frames of
    at most ``max_frame`` bytes, and ``pending_limit`` bytes of unfinished big frames on all
    connections together (:mod:`kvxferd.service.local_calls` says what is refused, and how)."""

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
        max_connections: int = MAX_CONNECTIONS,
        max_frame: int = MAX_FRAME,
        pending_limit: int = PENDING_LIMIT,
    ) -> None:
        if len(path.encode()) > MAX_PATH:
            raise ValueError(f"the socket path is over {MAX_PATH} bytes: {path}")
        self.path = path
        self.name, self._methods, self._mode = name, methods, mode
        self.max_connections, self.max_frame = max_connections, max_frame
        self.pending = PendingBytes(pending_limit)
        self._service = service
        self._m = metrics
        self._expected = f"Bearer {token}".encode() if token else b""
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[Calls] = set()
        self._refused, self._warned_at = 0, -OVER_CAP_LOG_S

    def over_cap_why(self) -> str:
        return (
            f"this {self.name} socket ({self.path}) already has its {self.max_connections}"
            " connections open"
        )

    def refused_connection(self) -> None:
        """A connection past the cap was refused: say so in the log, at most once a minute."""
        self._refused += 1
        now = time.monotonic()
        if now - self._warned_at >= OVER_CAP_LOG_S:
            self._warned_at = now
            log.warning(
                "refusing connections past the local socket's limit",
                extra=kv(
                    why=self.over_cap_why(),
                    refused=self._refused,
                    socket=self.path,
                    fix="find the process on this host that holds so many connections to it"
                    " (ss -xp shows them): a caller needs one connection per concurrent call at"
                    " most; docs/operations.md lists the limit",
                ),
            )

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
            self._server = await loop.create_unix_server(lambda: Calls(self), self.path)
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
