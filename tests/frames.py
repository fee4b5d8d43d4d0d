"""Reading the Unix-socket channels' frames (kvxferd/wire/local.py) from an asyncio stream, for
the tests' own servers and raw clients (the daemon itself splits frames in its protocols with
FrameSplitter)."""

from __future__ import annotations

import asyncio

from kvxferd.wire.splitter import HEADER, MAX_FRAME, FrameError


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    """``(call id, kind, body)``; IncompleteReadError at a clean end of stream."""
    size, call_id, kind = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > MAX_FRAME:
        raise FrameError(f"a frame of {size} bytes is over the {MAX_FRAME}-byte limit")
    return call_id, kind, await reader.readexactly(size) if size else b""
