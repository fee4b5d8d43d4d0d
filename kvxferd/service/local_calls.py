"""One connection to a :class:`~kvxferd.service.local_peer.LocalPeerServer`: its frames in, its
calls started, its answers out, and what a connection may make the daemon hold.

Limits (each server's, set by :mod:`kvxferd.service.sockets`; docs/operations.md lists them):

* ``max_connections`` open at once. One past it has its first frame answered
  RESOURCE_EXHAUSTED (if it comes within :data:`OVER_CAP_GRACE_S`) and is closed; the
  daemon's log says so at most once a minute.
* a frame of at most ``max_frame`` bytes; and an unfinished frame over
  :data:`~kvxferd.wire.splitter.FREE_PENDING` bytes waits only while the socket's shared
  :class:`~kvxferd.wire.splitter.PendingBytes` has room for it. A frame over either is answered
  RESOURCE_EXHAUSTED and its bytes are passed over as they come: the connection serves on.
* a frame that breaks the format (an unknown kind, a call ID in use) is answered
  INVALID_ARGUMENT and closes the connection. A request whose body does not parse is answered
  by the server without closing anything.

So a process that may connect holds at most ``max_connections`` x ``FREE_PENDING`` plus
``PendingBytes.limit`` bytes of unfinished frames, however many connections it opens.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import grpc

from kvxferd import busypoll
from kvxferd.logs import kv
from kvxferd.tasks import start_now
from kvxferd.wire.local import CANCEL, REQUEST, answer_frame
from kvxferd.wire.splitter import FrameError, FrameSplitter

if TYPE_CHECKING:
    from kvxferd.service.local_peer import LocalPeerServer

log = logging.getLogger(__name__)

FRAME_FIX = (
    "frame calls as kvxferd/wire/local.py describes, as kvxferd.wire.scheduler_socket and"
    " kvxferd.client do"
)
# How long a connection past the cap may take to send the call it is refused in.
OVER_CAP_GRACE_S = 1.0
OVER_CAP_FIX = (
    "close idle connections (one kvxferd.wire.local.LocalTransport or AsyncSchedulerSocket"
    " carries any number of concurrent calls), or make the call over gRPC"
)

# Answers a connection may leave unread before it stops being read: past this many bytes
# waiting in its write buffer, the frames already read wait unstarted and reading pauses until
# the caller has taken most of its answers (asyncio's flow control: pause_writing and
# resume_writing). A caller that sends requests and never reads the answers thus holds at most
# this much of the daemon's memory (plus one read of frames and the answers of calls running),
# however many it sends.
WRITE_HIGH_WATER = 4 << 20


def _forget(calls: dict[int, asyncio.Task[None]], call_id: int, _: object) -> None:
    calls.pop(call_id, None)


class _Skipping:
    """In place of a connection's splitter while the rest of a refused frame arrives."""

    __slots__ = ("conn", "left", "splitter")

    def __init__(self, conn: Calls, splitter: FrameSplitter, left: int) -> None:
        self.conn, self.splitter, self.left = conn, splitter, left

    def feed(self, data: bytes) -> Iterable[tuple[int, int, bytes]]:
        if len(data) < self.left:
            self.left -= len(data)
            return ()
        self.conn._frames = self.splitter
        return self.splitter.feed(data[self.left :])

    def drop(self) -> None:
        self.splitter.drop()


class Calls(asyncio.Protocol):
    """One connection to a :class:`LocalPeerServer`: each REQUEST frame starts its call as the
    bytes arrive (:func:`kvxferd.tasks.start_now`: a handler that answers without waiting has
    written its answer before this returns), a CANCEL frame cancels that call, and a refused
    frame is answered as the module docstring says. While the connection's unread answers
    exceed :data:`WRITE_HIGH_WATER`, frames wait in order and nothing more is read."""

    def __init__(self, server: LocalPeerServer) -> None:
        self._server = server
        self._frames: FrameSplitter | _Skipping = FrameSplitter(server.max_frame, server.pending)
        self._calls: dict[int, asyncio.Task[None]] = {}
        self._held: collections.deque[tuple[int, int, bytes]] = collections.deque()
        self._backed_up = False
        self._over_cap: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        if len(self._server._conns) >= self._server.max_connections:
            # Past the cap: its first frame is refused at its header (nothing buffered).
            self._frames = FrameSplitter(-1)
            loop = asyncio.get_running_loop()
            self._over_cap = loop.call_later(OVER_CAP_GRACE_S, self.close)
            self._server.refused_connection()
            return
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
        busypoll.touch()  # a call arrived: keep the loop awake for the rest of its exchange
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
                raise FrameError(
                    f"call ID {call_id} is already in use by a running call", call_id=call_id
                )
            call = start_now(self._server._serve(call_id, body, self.transport))
            if not call.done():
                self._calls[call_id] = call
                call.add_done_callback(functools.partial(_forget, self._calls, call_id))
        elif kind == CANCEL:
            running = self._calls.pop(call_id, None)
            if running is not None:
                running.cancel()
        else:
            raise FrameError(
                f"unexpected frame kind {kind}: a caller sends REQUEST ({REQUEST}) and CANCEL"
                f" ({CANCEL}) frames",
                call_id=call_id,
            )

    def _refuse(self, exc: FrameError) -> None:
        """Answer the call a refused frame named (when its header was read), then pass over
        the frame (one over a size limit: the stream is still in step) or close."""
        server = self._server
        if self._over_cap is not None:
            self._answer(exc.call_id, server.over_cap_why(), OVER_CAP_FIX)
            self.close()
            return
        self._answer(exc.call_id, str(exc), exc.fix or FRAME_FIX, exc.code)
        skip = exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        log.warning(
            "refused a frame on a local socket, " + ("skipping it" if skip else "closing"),
            extra=kv(why=str(exc), service=server.name, socket=server.path),
        )
        if skip and isinstance(self._frames, FrameSplitter):
            left = self._frames.skip()
            if left:
                self._frames = _Skipping(self, self._frames, left)
            else:
                self.data_received(b"")  # the frames that came after it
            return
        self._held.clear()
        self.close()

    def _answer(
        self,
        call_id: int | None,
        why: str,
        fix: str,
        code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED,
    ) -> None:
        if call_id is not None and self.transport is not None and not self.transport.is_closing():
            self.transport.write(answer_frame(call_id, code, f"{why} (fix: {fix})"))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server._conns.discard(self)
        if self._over_cap is not None:
            self._over_cap.cancel()
        self._frames.drop()
        self._held.clear()
        for call in self._calls.values():
            call.cancel()
        self._calls.clear()
        if not self.lost.done():
            self.lost.set_result(None)
