"""Cutting a Unix-socket channel's byte stream into frames (the frames: :mod:`kvxferd.wire.local`),
within the limits a server sets on what its callers may make it hold.

A frame is handed on only once all of it has arrived, so the bytes of an unfinished one wait in
memory, and they arrive before the caller's token is checked (the token is in the frame). A
server therefore bounds them per socket, not per connection: a frame of up to
:data:`FREE_PENDING` bytes may wait on any connection (the number of connections is capped by
the server), a bigger one must first reserve its whole size from the socket's
:class:`PendingBytes`, which every connection of the socket shares. Reserving happens only for
a big frame that did not arrive whole in one read: a frame that does (the usual case) costs
nothing more than the comparison of its size with the limit.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import grpc

HEADER = struct.Struct("!IIB")
MAX_FRAME = 16 << 20  # the default frame limit, far above any request these sockets carry
FREE_PENDING = 64 << 10  # an unfinished frame up to this size reserves nothing
# Bytes a socket's unfinished big frames may hold together (two frames of MAX_FRAME).
PENDING_LIMIT = 2 * MAX_FRAME


class FrameError(Exception):
    """A frame that does not follow the format of :mod:`kvxferd.wire.local` or is over a limit.
    ``call_id``: the call its header named, when the header was read (a server answers that
    call with ``code``, and ``fix``, before it closes the connection or skips the frame)."""

    def __init__(
        self,
        message: str,
        *,
        call_id: int | None = None,
        code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
        fix: str = "",
    ) -> None:
        super().__init__(message)
        self.call_id, self.code, self.fix = call_id, code, fix


class PendingBytes:
    """The bytes the unfinished big frames of one socket's connections may hold together."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int = PENDING_LIMIT) -> None:
        self.limit = limit
        self.used = 0


class FrameSplitter:
    """The frames in a byte stream, as it arrives in pieces (an ``asyncio.Protocol``'s
    ``data_received``): :meth:`feed` yields each ``(call id, kind, body)`` completed by the
    new bytes and keeps the rest. A header announcing more than ``limit`` bytes, or an
    unfinished frame over :data:`FREE_PENDING` bytes that ``pending`` has no room for, raises
    :class:`FrameError` (RESOURCE_EXHAUSTED, the call ID set) when reached, after the frames
    before it were yielded; :meth:`skip` then passes over that frame's bytes."""

    __slots__ = ("_buf", "_charged", "limit", "pending")

    def __init__(self, limit: int = MAX_FRAME, pending: PendingBytes | None = None) -> None:
        self._buf = bytearray()
        self.limit = limit
        self.pending = pending
        self._charged = 0  # reserved from pending for the unfinished frame the buffer starts with

    def feed(self, data: bytes) -> Iterator[tuple[int, int, bytes]]:
        if self._buf:
            self._buf += data
            view: bytes | bytearray = self._buf
        else:
            view = data  # the usual case: whole frames in one read, no copy into the buffer
        at, end = 0, len(view)
        charged, charging = self._charged, 0
        try:
            while end - at >= HEADER.size:
                size, call_id, kind = HEADER.unpack_from(view, at)
                if size > self.limit:
                    raise self._too_big(call_id, size)
                stop = at + HEADER.size + size
                if stop > end:
                    if size > FREE_PENDING and not (at == 0 and charged):
                        charging = self._reserve(call_id, size)
                    break
                yield call_id, kind, bytes(view[at + HEADER.size : stop])
                at = stop
        finally:
            if charged and at:  # the frame reserved for has come whole
                self._release()
            if charging:
                self._charged = charging
            if view is self._buf:
                del self._buf[:at]
            else:
                self._buf += view[at:]

    def _too_big(self, call_id: int, size: int) -> FrameError:
        return FrameError(
            f"a frame of {size} bytes is over the {self.limit}-byte limit of this socket",
            call_id=call_id,
            code=grpc.StatusCode.RESOURCE_EXHAUSTED,
            fix="send fewer block IDs in one call (split the pull), or make this call over"
            " gRPC (messages up to 64 MiB); docs/operations.md lists the sockets' limits",
        )

    def _reserve(self, call_id: int, size: int) -> int:
        pending = self.pending
        if pending is None:
            return 0
        if pending.used + size > pending.limit:
            raise FrameError(
                f"a frame of {size} bytes cannot wait for its end: the unfinished frames on"
                f" this socket's connections already hold {pending.used} of the"
                f" {pending.limit} bytes they may",
                call_id=call_id,
                code=grpc.StatusCode.RESOURCE_EXHAUSTED,
                fix="retry once the other big calls are through, or make this call over gRPC;"
                " if no caller of yours sends big calls, a process on this host holds"
                " connections with unfinished frames (docs/operations.md)",
            )
        pending.used += size
        return size

    def _release(self) -> None:
        if self._charged and self.pending is not None:
            self.pending.used -= self._charged
        self._charged = 0

    def skip(self) -> int:
        """After :meth:`feed` refused a frame for its size: drop what arrived of it; returns how
        many of its bytes are still to come (to be dropped as they arrive, then :meth:`feed`
        the rest: the stream is still in step). Frames after it that arrived are kept."""
        self._release()
        size: int = HEADER.unpack_from(self._buf)[0]
        end = HEADER.size + size
        left = max(0, end - len(self._buf))
        del self._buf[:end]
        return left

    def drop(self) -> None:
        """The connection ended: let go of what it held."""
        self._release()
        self._buf.clear()
