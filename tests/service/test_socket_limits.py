"""What a caller of the daemon's Unix sockets (the same-host Peer socket, the scheduler socket)
may make the daemon hold, and what it is told when it asks for more (kvxferd/service/
local_calls.py, kvxferd/wire/splitter.py; docs/operations.md lists the limits).

Before: each connection could hold an unfinished frame of up to 16 MiB, with no cap on the
connections, all before its token was checked (30 connections added ~480 MB to a daemon), and
a frame over the limit, or of an unknown kind, closed the connection without a word."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import uvloop
from prometheus_client import CollectorRegistry

from kvxferd.metrics import Metrics
from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.service.local_peer import LocalPeerServer
from kvxferd.v1 import peer_pb2, scheduler_pb2
from kvxferd.wire.local import ANSWER, HEADER, parse_answer, request_frame
from kvxferd.wire.splitter import FREE_PENDING, FrameError, FrameSplitter, PendingBytes
from tests.frames import read_frame
from tests.service.conftest import Daemons, launch

LOOPS = [asyncio.new_event_loop, uvloop.new_event_loop]
BIG = 400 << 10  # a frame that must reserve room to wait for its end (over FREE_PENDING)


class Service:
    async def Heartbeat(self, request: Any, context: Any) -> peer_pb2.HeartbeatResponse:  # noqa: N802
        return peer_pb2.HeartbeatResponse(instance_id=request.instance_id[:8])


def _run(loop_factory: Callable[[], asyncio.AbstractEventLoop], main: Awaitable[None]) -> None:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main)  # type: ignore[arg-type]


async def _server(path: Path, **limits: int) -> LocalPeerServer:
    server = LocalPeerServer(Service(), Metrics.create(CollectorRegistry()), str(path), **limits)
    await server.start()
    return server


def _heartbeat(call_id: int, pad: int = 0) -> bytes:
    msg = peer_pb2.HeartbeatRequest(instance_id="i" * pad or "inst")
    return request_frame(call_id, "Heartbeat", (), 5.0, msg)


async def _answer(reader: asyncio.StreamReader, call_id: int) -> tuple[grpc.StatusCode, str]:
    got, kind, body = await asyncio.wait_for(read_frame(reader), 5)
    assert (got, kind) == (call_id, ANSWER)
    code, text, _, _ = parse_answer(body)
    return code, text


class Conns:
    """Raw connections to a server, all closed by :meth:`close`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.writers: list[asyncio.StreamWriter] = []

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_unix_connection(self.path)
        self.writers.append(writer)
        return reader, writer

    async def close(self) -> None:
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def _until(cond: Callable[[], bool]) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_unfinished_big_frames_share_one_budget_and_one_past_it_is_answered_and_skipped(
    tmp_path: Path, loop_factory: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    async def main() -> None:
        server = await _server(tmp_path / "s.sock", pending_limit=2 * BIG + 1000)
        raw = Conns(server.path)
        conns = [await raw.open() for _ in range(3)]
        frames = [_heartbeat(i + 1, pad=BIG) for i in range(3)]
        for (_, writer), data in zip(conns, frames, strict=True):
            writer.write(data[: 100 << 10])  # its header and the start of its body
        await asyncio.sleep(0.1)
        # The third did not fit beside the two others: refused under its call ID, at once.
        code, text = await _answer(conns[2][0], 3)
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, text
        assert "cannot wait for its end" in text and "fix:" in text and "gRPC" in text
        assert server.pending.used <= server.pending.limit
        # Its bytes are passed over as they come, and the connection serves on.
        conns[2][1].write(frames[2][100 << 10 :] + _heartbeat(9))
        assert (await _answer(conns[2][0], 9))[0] is grpc.StatusCode.OK
        # The first two end their frames and are answered; nothing is held any more.
        for i in (0, 1):
            conns[i][1].write(frames[i][100 << 10 :])
            assert (await _answer(conns[i][0], i + 1))[0] is grpc.StatusCode.OK
        assert server.pending.used == 0
        # A connection that goes away mid-frame gives its room back.
        _, writer = await raw.open()
        writer.write(frames[0][: 100 << 10])
        await _until(lambda: server.pending.used == len(frames[0]) - HEADER.size)
        writer.close()
        await _until(lambda: server.pending.used == 0)
        await raw.close()
        await server.close()

    _run(loop_factory, main())


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_a_frame_over_the_limit_is_answered_and_the_connection_serves_on(
    tmp_path: Path, loop_factory: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    async def main() -> None:
        server = await _server(tmp_path / "s.sock", max_frame=64 << 10)
        raw = Conns(server.path)
        reader, writer = await raw.open()
        writer.write(_heartbeat(4, pad=200 << 10) + _heartbeat(5))
        code, text = await _answer(reader, 4)
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"over the {64 << 10}-byte limit" in text and "split" in text
        assert (await _answer(reader, 5))[0] is grpc.StatusCode.OK  # the frame after it
        await raw.close()
        await server.close()

    _run(loop_factory, main())


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_connections_past_the_cap_are_answered_why_and_closed(
    tmp_path: Path, loop_factory: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    async def main() -> None:
        server = await _server(tmp_path / "s.sock", max_connections=3)
        raw = Conns(server.path)
        conns = [await raw.open() for _ in range(3)]
        for i, (reader, writer) in enumerate(conns):
            writer.write(_heartbeat(i))
            assert (await _answer(reader, i))[0] is grpc.StatusCode.OK
        reader, writer = await raw.open()
        writer.write(_heartbeat(7))
        code, text = await _answer(reader, 7)
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "already has its 3 connections open" in text and "fix:" in text
        assert await asyncio.wait_for(reader.read(), 5) == b""  # and closed
        # One that says nothing is closed too, soon.
        idle, _ = await raw.open()
        assert await asyncio.wait_for(idle.read(), 5) == b""
        # Once one of the three goes, a new connection is served.
        conns[0][1].close()
        await _until(lambda: len(server._conns) == 2)
        reader, writer = await raw.open()
        writer.write(_heartbeat(8))
        assert (await _answer(reader, 8))[0] is grpc.StatusCode.OK
        await raw.close()
        await server.close()

    _run(loop_factory, main())


def test_the_splitter_gives_back_every_reserved_byte_and_stays_in_step() -> None:
    pending = PendingBytes(3 * BIG)
    max_frame = 2 * BIG
    splitter = FrameSplitter(max_frame, pending)
    frames = [_heartbeat(1, pad=BIG), _heartbeat(2), _heartbeat(3, pad=max_frame + 1)]
    stream = b"".join(frames) + _heartbeat(4)
    got: list[int] = []
    refused: list[int | None] = []
    at = 0
    while at < len(stream):
        piece, at = stream[at : at + 50_000], at + 50_000
        try:
            for cid, _, _ in splitter.feed(piece):
                got.append(cid)
        except FrameError as exc:
            refused.append(exc.call_id)
            left = splitter.skip()
            at += left  # the rest of that frame, as if dropped as it came
            got += [cid for cid, _, _ in splitter.feed(b"")]
        assert pending.used <= pending.limit
        assert pending.used in (0, len(frames[0]) - HEADER.size)
    assert (got, refused, pending.used) == ([1, 2, 4], [3], 0)
    assert FREE_PENDING < BIG


# -- a real daemon ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemons, str, int]]:
    ds = launch(
        tmp_path_factory.mktemp("limits"),
        DaemonOptions(
            "d",
            "dense:num_blocks=8",
            scheduler_socket=True,
            extra=("--set", "transfer.max_inflight=4"),
        ),
    )
    ready = ds.set["d"].ready
    assert ready is not None
    yield ds, ready.scheduler_socket, ready.pid
    ds.stop()


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) >> 10


def test_unfinished_frames_on_many_connections_do_not_grow_the_daemon(
    daemon: tuple[Daemons, str, int],
) -> None:
    ds, path, pid = daemon
    before = _rss_mb(pid)
    socks = []
    try:
        for i in range(10):  # each announces a 16 MiB frame and sends all of it but a byte
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            s.connect(path)
            s.sendall(HEADER.pack(16 << 20, i, 1) + b"\0" * ((16 << 20) - 1))
            socks.append(s)
        time.sleep(0.5)
        grown = _rss_mb(pid) - before
        assert grown < 80, f"the daemon grew by {grown} MB"  # was ~160 MB (16 MiB each)
    finally:
        for s in socks:
            s.close()
    assert ds["d"].alive()  # type: ignore[operator]


def test_the_scheduler_socket_serves_max_inflight_plus_room_and_refuses_more(
    daemon: tuple[Daemons, str, int],
) -> None:
    ds, path, _ = daemon
    cap = 4 + 256  # transfer.max_inflight + MAX_CONNECTIONS (kvxferd/service/sockets.py)
    socks = []
    try:
        for _ in range(cap):
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            socks.append(s)
        time.sleep(0.3)
        extra = socket.socket(socket.AF_UNIX)
        extra.settimeout(5)
        extra.connect(path)
        extra.sendall(request_frame(3, "ListPeers", (), 5.0, scheduler_pb2.ListPeersRequest()))
        got = b""
        while chunk := extra.recv(65536):
            got += chunk
        extra.close()
        code, text, _, _ = parse_answer(got[HEADER.size :])
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"already has its {cap} connections open" in text
    finally:
        for s in socks:
            s.close()
    assert ds["d"].alive()  # type: ignore[operator]
