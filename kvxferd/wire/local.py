"""The same-host Peer channel: Peer calls as short frames over a Unix socket.

Two daemons on one host still pay a whole gRPC round trip (0.5-0.7 ms of Python and gRPC
core, measured in docs/benchmarks.md) for every ConfirmLease, which sits on each pull's critical
path. An owner daemon therefore also serves the Peer calls of a pull's lifetime on a Unix socket
(:mod:`kvxferd.service.local_peer`) and advertises its path in the handshake
(``HandshakePayload.local_socket``); a reader on the same host that can reach it sends those
calls through :class:`LocalTransport` instead. The requests and answers are the Peer service's
own protobuf messages; only the envelope differs. Handshake and Push always use gRPC.

The same frames carry the Scheduler's unary calls (:data:`SCHEDULER_METHODS`) for a caller on
the decode daemon's host (a scheduler or the vLLM connector beside it) when the daemon serves
``server.scheduler_socket``: a StartPull with ``wait`` then costs a frame each way instead of a
gRPC round trip. The blocking caller is :class:`kvxferd.wire.scheduler_socket.SchedulerSocket`.

Frames (all integers big-endian)::

    header   u32 body length | u32 call id | u8 kind
    REQUEST  u16 method len | u16 metadata len | u32 timeout (us) | method | metadata | request
    ANSWER   u8 status code | u16 details len | u16 trailer len | details | trailer | answer
    CANCEL   (empty body): the caller gave up on that call

Metadata and trailer are JSON lists of ``[key, value]``; a key ending in ``-bin`` carries
bytes, hex-encoded. A failed call raises :class:`~kvxferd.wire.peer_client.RpcFailure` with the
status code, details and trailer a gRPC server would have sent, so callers map errors exactly
as they do for gRPC (:func:`kvxferd.wire.errors.error_from_rpc`). Cutting the stream into
frames, and the limits a server puts on what its callers may make it hold before their token is
checked: :mod:`kvxferd.wire.splitter`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import socket
import struct
from collections.abc import Sequence
from typing import Any, cast

import grpc

from kvxferd import busypoll
from kvxferd.v1 import peer_pb2, scheduler_pb2
from kvxferd.wire.errors import clip
from kvxferd.wire.peer_client import Metadata, NotSent, RpcFailure
from kvxferd.wire.splitter import HEADER, FrameError, FrameSplitter  # and the frame limits

REQUEST_HEAD = struct.Struct("!HHI")
ANSWER_HEAD = struct.Struct("!BHH")
REQUEST, ANSWER, CANCEL = 1, 2, 3

# The Peer calls the channel carries: name -> (request type, answer type).
METHODS: dict[str, tuple[type[Any], type[Any]]] = {
    "ConfirmLease": (peer_pb2.ConfirmLeaseRequest, peer_pb2.ConfirmLeaseResponse),
    "ExtendLease": (peer_pb2.ExtendLeaseRequest, peer_pb2.ExtendLeaseResponse),
    "ReleaseLease": (peer_pb2.ReleaseLeaseRequest, peer_pb2.ReleaseLeaseResponse),
    "DeclineLease": (peer_pb2.DeclineLeaseRequest, peer_pb2.DeclineLeaseResponse),
    "Heartbeat": (peer_pb2.HeartbeatRequest, peer_pb2.HeartbeatResponse),
    "Gather": (peer_pb2.GatherRequest, peer_pb2.GatherResponse),
    "ReleaseStaging": (peer_pb2.ReleaseStagingRequest, peer_pb2.ReleaseStagingResponse),
}

# The Scheduler calls a caller on the daemon's host may also send on its scheduler socket
# (server.scheduler_socket): the unary calls of a pull's lifetime. WatchTransfers (a stream)
# and Checksum stay on gRPC.
SCHEDULER_METHODS: dict[str, tuple[type[Any], type[Any]]] = {
    "StartPull": (scheduler_pb2.StartPullRequest, scheduler_pb2.StartPullResponse),
    "GetTransfer": (scheduler_pb2.GetTransferRequest, scheduler_pb2.GetTransferResponse),
    "CancelTransfer": (scheduler_pb2.CancelTransferRequest, scheduler_pb2.CancelTransferResponse),
    "DeclinePull": (scheduler_pb2.DeclinePullRequest, scheduler_pb2.DeclinePullResponse),
    "ListPeers": (scheduler_pb2.ListPeersRequest, scheduler_pb2.ListPeersResponse),
}

_CODES = {c.value[0]: c for c in grpc.StatusCode}


# A connection sends the same metadata (its token, its session) with every call: each side
# keeps the last few encodings, up to this size each, instead of redoing the JSON per call.
_PAIRS_CACHED = 64
_PAIRS_CACHE_MAX_BYTES = 1024


def encode_pairs(pairs: Sequence[tuple[str, str | bytes]]) -> bytes:
    if isinstance(pairs, tuple):
        with contextlib.suppress(TypeError):  # unhashable: encoded below
            return _encoded_pairs(pairs)
    return _encode_pairs(pairs)


@functools.lru_cache(maxsize=_PAIRS_CACHED)
def _encoded_pairs(pairs: tuple[tuple[str, str | bytes], ...]) -> bytes:
    return _encode_pairs(pairs)


def _encode_pairs(pairs: Sequence[tuple[str, str | bytes]]) -> bytes:
    out = [[k, v.hex() if isinstance(v, bytes) else v] for k, v in pairs]
    return json.dumps(out, separators=(",", ":")).encode()


def decode_pairs(raw: bytes) -> tuple[tuple[str, str | bytes], ...]:
    """The metadata of a frame; :class:`FrameError` when it does not decode."""
    if not raw:
        return ()
    if len(raw) <= _PAIRS_CACHE_MAX_BYTES:
        return _decoded_pairs(bytes(raw))
    return _decode_pairs(raw)


@functools.lru_cache(maxsize=_PAIRS_CACHED)
def _decoded_pairs(raw: bytes) -> tuple[tuple[str, str | bytes], ...]:
    return _decode_pairs(raw)  # an error is raised again for each call (never cached)


def _decode_pairs(raw: bytes) -> tuple[tuple[str, str | bytes], ...]:
    try:
        items = json.loads(raw)
        pairs: list[tuple[str, str | bytes]] = []
        for key, value in items:
            if not isinstance(key, str) or not isinstance(value, str):
                raise FrameError("metadata keys and values must be strings")
            pairs.append((key, bytes.fromhex(value) if key.endswith("-bin") else value))
    except (ValueError, TypeError) as exc:
        raise FrameError(f"undecodable metadata: {exc}") from exc
    except RecursionError:  # JSON nested deeper than the interpreter's stack
        raise FrameError("undecodable metadata: nested too deeply") from None
    return tuple(pairs)


def frame(call_id: int, kind: int, *parts: bytes) -> bytes:
    body = b"".join(parts)
    return HEADER.pack(len(body), call_id, kind) + body


def request_frame(
    call_id: int, method: str, metadata: Metadata, timeout_s: float, msg: Any
) -> bytes:
    name, meta = method.encode(), encode_pairs(metadata)
    timeout_us = max(0, min(int(timeout_s * 1e6), 0xFFFFFFFF))
    head = REQUEST_HEAD.pack(len(name), len(meta), timeout_us)
    return frame(call_id, REQUEST, head, name, meta, msg.SerializeToString())


def parse_request(body: bytes) -> tuple[str, tuple[tuple[str, str | bytes], ...], float, bytes]:
    """``(method, metadata, timeout_s, request bytes)`` of a REQUEST body."""
    if len(body) < REQUEST_HEAD.size:
        raise FrameError("a request frame shorter than its header")
    n_name, n_meta, timeout_us = REQUEST_HEAD.unpack_from(body)
    at = REQUEST_HEAD.size
    if at + n_name + n_meta > len(body):
        raise FrameError("a request frame shorter than its method and metadata")
    try:
        method = body[at : at + n_name].decode()
    except UnicodeDecodeError as exc:
        raise FrameError("a method name that is not UTF-8") from exc
    meta = decode_pairs(body[at + n_name : at + n_name + n_meta])
    return method, meta, timeout_us / 1e6, body[at + n_name + n_meta :]


# An answer's details and trailer are sized by u16 fields: the details are cut to this many
# bytes (a message that repeats a caller's long input), and a trailer that does not fit is
# dropped (the details still say what went wrong).
MAX_DETAILS = 4096
MAX_TRAILER = 0xFFFF


def answer_frame(
    call_id: int,
    code: grpc.StatusCode,
    details: str = "",
    trailer: Sequence[tuple[str, str | bytes]] = (),
    answer: bytes = b"",
) -> bytes:
    text, trail = clip(details, MAX_DETAILS).encode(), encode_pairs(trailer)
    if len(trail) > MAX_TRAILER:
        trail = b""
    head = ANSWER_HEAD.pack(code.value[0], len(text), len(trail))
    return frame(call_id, ANSWER, head, text, trail, answer)


def parse_answer(
    body: bytes,
) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str | bytes], ...], bytes]:
    if len(body) < ANSWER_HEAD.size:
        raise FrameError("an answer frame shorter than its header")
    code, n_text, n_trail = ANSWER_HEAD.unpack_from(body)
    at = ANSWER_HEAD.size
    if at + n_text + n_trail > len(body):
        raise FrameError("an answer frame shorter than its details and trailer")
    text = body[at : at + n_text].decode(errors="replace")
    trailer = decode_pairs(body[at + n_text : at + n_text + n_trail])
    return _CODES.get(code, grpc.StatusCode.UNKNOWN), text, trailer, body[at + n_text + n_trail :]


def answer_message(body: bytes, answer_type: type[Any]) -> Any:
    """The answer message of an ANSWER body, or the call's failure as :class:`RpcFailure`."""
    code, details, trailer, answer = parse_answer(body)
    if code is not grpc.StatusCode.OK:
        raise RpcFailure(code, details, trailer)
    msg = answer_type()
    msg.ParseFromString(answer)
    return msg


PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket, as the
    kernel recorded it (``SO_PEERCRED``, translated into this process's PID namespace: pid 0
    when that process is not visible here)."""
    pid, uid, gid = PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size)
    )
    return pid, uid, gid


class _Answers(asyncio.Protocol):
    """One connection of a :class:`LocalTransport`: hands each ANSWER frame to the call
    waiting for it as the bytes arrive (no reading task, so no loop turn between the answer's
    arrival and its caller's wake-up) and fails that connection's calls when it breaks."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: dict[int, asyncio.Future[bytes]] = {}
        self._frames = FrameSplitter()
        self._why = "the owner closed its local Peer socket"
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        busypoll.touch()  # an answer: the call that waits for it goes on at once
        try:
            for call_id, kind, body in self._frames.feed(data):
                fut = self.waiting.pop(call_id, None)
                if kind == ANSWER and fut is not None and not fut.done():
                    fut.set_result(body)
        except FrameError as exc:
            self._why = f"the local Peer socket broke: {exc}"
            assert self.transport is not None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        why = f"the local Peer socket broke: {exc}" if exc is not None and str(exc) else self._why
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(RpcFailure(grpc.StatusCode.UNAVAILABLE, why, ()))
        self.waiting.clear()
        if not self.lost.done():
            self.lost.set_result(None)

    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()


class _Expired(Exception):
    """A call's deadline passed before its answer came."""


def _expire(fut: asyncio.Future[bytes]) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


class LocalTransport:
    """A :class:`~kvxferd.wire.peer_client.Transport` over the owner's Unix socket: one
    connection, opened on first use and again after it breaks; calls are multiplexed by ID.
    A broken connection fails the calls on it with UNAVAILABLE (the reader then re-handshakes,
    as after any failed Peer call).

    ``connection`` numbers the connections opened (the open one's, while open) and ``peer``
    holds the kernel's credentials of the process at its other end (``SO_PEERCRED``; None
    while no connection is open): CMA pulls read that process (:mod:`kvxferd.ipc.cma`)."""

    def __init__(
        self, path: str, methods: dict[str, tuple[type[Any], type[Any]]] = METHODS
    ) -> None:
        self.path = path
        self._methods = methods  # the calls this socket serves (the Scheduler's: SCHEDULER_METHODS)
        self.connection = 0
        self._peer: tuple[int, int, int] | None = None
        self._ids = itertools.count(1)
        self._conn: _Answers | None = None
        self._opening: asyncio.Lock | None = None

    @property
    def peer(self) -> tuple[int, int, int] | None:
        return self._peer if self._conn is not None and self._conn.open() else None

    async def _connect(self) -> _Answers:
        conn = self._conn
        if conn is not None and conn.open():
            return conn
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._conn is None or not self._conn.open():
                loop = asyncio.get_running_loop()
                transport, conn = await loop.create_unix_connection(_Answers, self.path)
                self._conn = conn
                self.connection += 1
                self._peer = peer_credentials(transport.get_extra_info("socket"))
            return self._conn

    async def __call__(
        self, method: str, request: Any, *, timeout: float, metadata: Metadata
    ) -> Any:
        types = self._methods.get(method)
        if types is None:
            raise RpcFailure(
                grpc.StatusCode.UNIMPLEMENTED, f"{method} is not served on the local socket", ()
            )
        try:
            conn = await self._connect()
        except OSError as exc:
            raise NotSent(
                grpc.StatusCode.UNAVAILABLE, f"cannot connect to {self.path}: {exc}", ()
            ) from exc
        call_id = next(self._ids) & 0xFFFFFFFF
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bytes] = loop.create_future()
        conn.waiting[call_id] = fut
        assert conn.transport is not None
        conn.transport.write(request_frame(call_id, method, metadata, timeout, request))
        # The deadline fails the answer's future itself (a timer, not asyncio.timeout: half
        # the cost, and nothing to undo when the answer comes first).
        timer = loop.call_at(loop.time() + timeout, _expire, fut)
        try:
            body = await fut
        except _Expired:
            self._cancel(conn, call_id)
            raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", ()) from None
        except asyncio.CancelledError:
            self._cancel(conn, call_id)
            raise
        finally:
            timer.cancel()
        return answer_message(body, types[1])

    def current(self, connection: int) -> bool:
        """Whether connection number ``connection`` is the one open now."""
        conn = self._conn
        return conn is not None and conn.open() and self.connection == connection

    @staticmethod
    def _cancel(conn: _Answers, call_id: int) -> None:
        conn.waiting.pop(call_id, None)
        if conn.open():
            assert conn.transport is not None
            conn.transport.write(frame(call_id, CANCEL))

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and conn.transport is not None:
            conn.transport.close()
            with contextlib.suppress(TimeoutError):  # connection_lost fails the calls left
                await asyncio.wait_for(asyncio.shield(conn.lost), 5)
