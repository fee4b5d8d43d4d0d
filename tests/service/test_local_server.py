"""The framed-call server of the Unix sockets (kvxferd/service/local_peer.py, LocalPeerServer)
with a service written here: calls start as their frames arrive and are answered under their
own call IDs, CANCEL cancels a running call, a malformed frame closes only its connection, and
closing the server cancels the calls still running. On asyncio's loop and on uvloop (the
daemon's), and with eager tasks where Python has them (kvxferd/tasks.py)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import uvloop
from prometheus_client import CollectorRegistry

from kvxferd.metrics import Metrics
from kvxferd.service.local_peer import LocalPeerServer
from kvxferd.v1 import peer_pb2
from kvxferd.wire.local import (
    ANSWER,
    CANCEL,
    HEADER,
    LocalTransport,
    parse_answer,
    request_frame,
)
from tests.frames import read_frame

LOOPS = [asyncio.new_event_loop, uvloop.new_event_loop]


class Service:
    """Heartbeat answers at once; ExtendLease waits until released (or cancelled)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started: list[str] = []
        self.cancelled: list[str] = []

    async def Heartbeat(self, request: Any, context: Any) -> peer_pb2.HeartbeatResponse:  # noqa: N802
        return peer_pb2.HeartbeatResponse(lost_request_ids=list(request.renew_request_ids))

    async def ExtendLease(self, request: Any, context: Any) -> peer_pb2.ExtendLeaseResponse:  # noqa: N802
        self.started.append(request.request_id)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        return peer_pb2.ExtendLeaseResponse()


def _run(loop_factory: Callable[[], asyncio.AbstractEventLoop], main: Awaitable[None]) -> None:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main)  # type: ignore[arg-type]


async def _server(path: Path) -> tuple[LocalPeerServer, Service]:
    svc = Service()
    server = LocalPeerServer(svc, Metrics.create(CollectorRegistry()), str(path))
    await server.start()
    return server, svc


async def _until(cond: Callable[[], bool]) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("condition not reached")


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_frames_in_one_write_are_each_answered_under_their_id(
    tmp_path: Path, loop_factory: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    async def main() -> None:
        server, _ = await _server(tmp_path / "s.sock")
        reader, writer = await asyncio.open_unix_connection(server.path)
        ids = [11, 12, 13]
        writer.write(
            b"".join(
                request_frame(
                    i, "Heartbeat", (), 5.0, peer_pb2.HeartbeatRequest(renew_request_ids=[f"r{i}"])
                )
                for i in ids
            )
        )
        got = {}
        for _ in ids:
            call_id, kind, body = await asyncio.wait_for(read_frame(reader), 5)
            assert kind == ANSWER
            code, _, _, answer = parse_answer(body)
            assert code is grpc.StatusCode.OK
            got[call_id] = peer_pb2.HeartbeatResponse.FromString(answer).lost_request_ids
        assert got == {i: [f"r{i}"] for i in ids}
        writer.close()
        await writer.wait_closed()
        await server.close()

    _run(loop_factory, main())


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_cancel_stops_a_running_call_and_the_connection_serves_on(
    tmp_path: Path, loop_factory: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    async def main() -> None:
        server, svc = await _server(tmp_path / "s.sock")
        reader, writer = await asyncio.open_unix_connection(server.path)
        writer.write(
            request_frame(1, "ExtendLease", (), 5.0, peer_pb2.ExtendLeaseRequest(request_id="a"))
        )
        await _until(lambda: svc.started == ["a"])
        writer.write(HEADER.pack(0, 1, CANCEL))
        await _until(lambda: svc.cancelled == ["a"])
        writer.write(request_frame(2, "Heartbeat", (), 5.0, peer_pb2.HeartbeatRequest()))
        call_id, kind, _ = await asyncio.wait_for(read_frame(reader), 5)
        assert (call_id, kind) == (2, ANSWER)  # nothing was answered for the cancelled call
        writer.close()
        await writer.wait_closed()
        await server.close()

    _run(loop_factory, main())


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_a_malformed_frame_closes_only_its_connection(
    tmp_path: Path, loop_factory: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    async def main() -> None:
        server, svc = await _server(tmp_path / "s.sock")
        good = LocalTransport(server.path)
        bad_reader, bad_writer = await asyncio.open_unix_connection(server.path)
        bad_writer.write(
            request_frame(1, "ExtendLease", (), 5.0, peer_pb2.ExtendLeaseRequest(request_id="b"))
        )
        await _until(lambda: svc.started == ["b"])
        bad_writer.write(HEADER.pack(0, 9, 77))  # no such frame kind
        got = await asyncio.wait_for(bad_reader.read(), 5)  # answered, then closed
        size, call_id, kind = HEADER.unpack_from(got)
        assert (call_id, kind, len(got)) == (9, ANSWER, HEADER.size + size)
        code, text, _, _ = parse_answer(got[HEADER.size :])
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "unexpected frame kind 77" in text
        bad_writer.close()
        await bad_writer.wait_closed()
        await _until(lambda: svc.cancelled == ["b"])  # and its running call cancelled
        answer = await good("Heartbeat", peer_pb2.HeartbeatRequest(), timeout=5, metadata=())
        assert isinstance(answer, peer_pb2.HeartbeatResponse)
        await good.close()
        await server.close()

    _run(loop_factory, main())


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_closing_the_server_cancels_running_calls_and_fails_the_callers(
    tmp_path: Path, loop_factory: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    async def main() -> None:
        server, svc = await _server(tmp_path / "s.sock")
        client = LocalTransport(server.path)
        call = asyncio.ensure_future(
            client(
                "ExtendLease",
                peer_pb2.ExtendLeaseRequest(request_id="c"),
                timeout=5,
                metadata=(),
            )
        )
        await _until(lambda: svc.started == ["c"])
        await server.close()
        assert svc.cancelled == ["c"]
        with pytest.raises(grpc.RpcError) as err:
            await asyncio.wait_for(call, 5)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert client.peer is None and not client.current(client.connection)
        await client.close()

    _run(loop_factory, main())


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_a_caller_that_reads_no_answers_stops_being_read_and_loses_no_call(
    tmp_path: Path, loop_factory: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    # Each Heartbeat's answer repeats its 4 KiB request: a caller that sends and never reads
    # would otherwise make the server buffer answers without bound. Past WRITE_HIGH_WATER of
    # unread answers the server stops reading, so the caller's sends block; once it reads,
    # every call it sent is answered, in order.
    async def main() -> None:
        server, _ = await _server(tmp_path / "s.sock")
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        await loop.sock_connect(sock, server.path)
        frames = [
            request_frame(
                i, "Heartbeat", (), 30.0, peer_pb2.HeartbeatRequest(renew_request_ids=["r" * 4096])
            )
            for i in range(1, 12_001)  # 49 MB of requests, as many of answers
        ]
        sent, pending, blocked_since = 0, b"", None
        while sent < len(frames) or pending:
            if not pending:
                pending = frames[sent]
                sent += 1
            try:
                pending = pending[sock.send(pending) :]
                blocked_since = None
            except BlockingIOError:
                blocked_since = blocked_since or loop.time()
                if loop.time() - blocked_since > 0.5:
                    break  # the server stopped reading
                await asyncio.sleep(0.005)
        assert blocked_since is not None, (
            "the server read every request of a caller that reads nothing"
        )
        assert sent * len(frames[0]) < 20 << 20  # ~4 MiB of answers, plus the socket buffers

        reader, writer = await asyncio.open_unix_connection(sock=sock)
        writer.write(pending + b"".join(frames[sent:]))  # the rest, sent as the answers are read
        sender = asyncio.ensure_future(writer.drain())
        for want in range(1, len(frames) + 1):
            call_id, kind, body = await asyncio.wait_for(read_frame(reader), 10)
            assert (call_id, kind) == (want, ANSWER)
            assert parse_answer(body)[0] is grpc.StatusCode.OK
        await sender
        writer.close()
        await server.close()

    _run(loop_factory, main())


@pytest.mark.parametrize("loop_factory", LOOPS)
def test_a_request_reusing_a_running_calls_id_closes_the_connection(
    tmp_path: Path, loop_factory: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    # A second call under the ID of one still running would make the first impossible to
    # cancel (a CANCEL names calls by ID): a protocol error, like a malformed frame.
    async def main() -> None:
        server, svc = await _server(tmp_path / "s.sock")
        reader, writer = await asyncio.open_unix_connection(server.path)
        first = peer_pb2.ExtendLeaseRequest(request_id="first")
        writer.write(request_frame(5, "ExtendLease", (), 30.0, first))
        await _until(lambda: svc.started == ["first"])
        writer.write(request_frame(5, "Heartbeat", (), 30.0, peer_pb2.HeartbeatRequest()))
        got = await asyncio.wait_for(reader.read(), 5)  # that call refused, then closed
        code, text, _, _ = parse_answer(got[HEADER.size :])
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "already in use" in text
        await _until(lambda: svc.cancelled == ["first"])
        writer.close()
        await writer.wait_closed()
        # A finished call's ID may be used again.
        reader, writer = await asyncio.open_unix_connection(server.path)
        for _ in range(2):
            writer.write(request_frame(7, "Heartbeat", (), 5.0, peer_pb2.HeartbeatRequest()))
            call_id, kind, _ = await asyncio.wait_for(read_frame(reader), 5)
            assert (call_id, kind) == (7, ANSWER)
        writer.close()
        await writer.wait_closed()
        await server.close()

    _run(loop_factory, main())
