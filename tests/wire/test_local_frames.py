"""The same-host Peer channel's frames and client transport (kvxferd/wire/local.py), against
a socket server written here: round trips, malformed frames, timeouts that send CANCEL, and a
broken connection that fails its calls and is reopened for the next."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from kvxferd.v1 import peer_pb2
from kvxferd.wire.local import (
    CANCEL,
    METHODS,
    REQUEST,
    FrameError,
    LocalTransport,
    answer_frame,
    decode_pairs,
    encode_pairs,
    parse_answer,
    parse_request,
    request_frame,
)
from kvxferd.wire.peer_client import LOCAL_METHODS, RpcFailure
from tests.frames import read_frame


def test_the_channel_carries_exactly_the_pull_lifetime_calls() -> None:
    assert set(METHODS) == LOCAL_METHODS
    assert "Handshake" not in METHODS and "Push" not in METHODS


def test_request_frame_round_trips() -> None:
    req = peer_pb2.ConfirmLeaseRequest(request_id="r-1", reader_id="me", extend_ms=300)
    raw = request_frame(7, "ConfirmLease", (("kvxferd-session", "ab12"),), 1.5, req)
    size, call_id, kind = int.from_bytes(raw[:4], "big"), int.from_bytes(raw[4:8], "big"), raw[8]
    assert (size, call_id, kind) == (len(raw) - 9, 7, REQUEST)
    method, meta, timeout, body = parse_request(raw[9:])
    assert method == "ConfirmLease" and meta == (("kvxferd-session", "ab12"),)
    assert timeout == pytest.approx(1.5)
    assert peer_pb2.ConfirmLeaseRequest.FromString(body) == req


def test_answer_frame_round_trips_binary_trailers() -> None:
    raw = answer_frame(
        3, grpc.StatusCode.NOT_FOUND, "no lease", (("kvxferd-error-bin", b"\x00\xff"),)
    )
    code, text, trailer, body = parse_answer(raw[9:])
    assert code is grpc.StatusCode.NOT_FOUND and text == "no lease" and body == b""
    assert trailer == (("kvxferd-error-bin", b"\x00\xff"),)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\x00\x05",
        b"\x00\x09\x00\x00\x00\x00\x00\x01abc",
        b"\x00\x01\x00\x03\x00\x00\x00\x01A[1",
    ],
)
def test_malformed_requests_raise_frame_error(body: bytes) -> None:
    with pytest.raises(FrameError):
        parse_request(body)


@pytest.mark.parametrize("raw", [b"{", b"[[1, 2]]", b'[["k-bin", "zz"]]', b'[["k"]]'])
def test_malformed_metadata_raises_frame_error(raw: bytes) -> None:
    with pytest.raises(FrameError):
        decode_pairs(raw)


def test_pairs_round_trip() -> None:
    pairs = (("authorization", "Bearer x"), ("x-bin", b"\x01\x02"))
    assert decode_pairs(encode_pairs(pairs)) == pairs


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(path: Path, handler: Handler) -> asyncio.AbstractServer:
    return await asyncio.start_unix_server(handler, str(path))


def test_a_call_gets_its_answer_and_errors_keep_code_and_trailer(tmp_path: Path) -> None:
    sock = tmp_path / "p.sock"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                call_id, _, body = await read_frame(reader)
            except asyncio.IncompleteReadError:
                writer.close()
                return
            method, meta, _, raw = parse_request(body)
            req = peer_pb2.HeartbeatRequest.FromString(raw)
            if req.daemon_id == "fail":
                writer.write(
                    answer_frame(
                        call_id, grpc.StatusCode.UNAUTHENTICATED, "who?", (("t-bin", b"x"),)
                    )
                )
            else:
                ans = peer_pb2.HeartbeatResponse(instance_id=f"{method}:{dict(meta)['s']}")
                writer.write(
                    answer_frame(call_id, grpc.StatusCode.OK, answer=ans.SerializeToString())
                )

    async def main() -> None:
        server = await _serve(sock, handler)
        t = LocalTransport(str(sock))
        ok = await t("Heartbeat", peer_pb2.HeartbeatRequest(), timeout=5, metadata=(("s", "1"),))
        assert ok.instance_id == "Heartbeat:1"
        with pytest.raises(RpcFailure) as err:
            await t(
                "Heartbeat", peer_pb2.HeartbeatRequest(daemon_id="fail"), timeout=5, metadata=()
            )
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert err.value.details() == "who?" and err.value.trailing_metadata() == (("t-bin", b"x"),)
        with pytest.raises(RpcFailure) as err:
            await t("Push", peer_pb2.PushRequest(), timeout=5, metadata=())
        assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED
        await t.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_a_timed_out_call_is_deadline_exceeded_and_cancelled_on_the_server(tmp_path: Path) -> None:
    sock = tmp_path / "p.sock"
    seen: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                _, kind, _ = await read_frame(reader)
            except asyncio.IncompleteReadError:
                writer.close()
                return
            seen.append(kind)  # never answers

    async def main() -> None:
        server = await _serve(sock, handler)
        t = LocalTransport(str(sock))
        with pytest.raises(RpcFailure) as err:
            await t("Heartbeat", peer_pb2.HeartbeatRequest(), timeout=0.05, metadata=())
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(100):
            if CANCEL in seen:
                break
            await asyncio.sleep(0.01)
        assert seen == [REQUEST, CANCEL]
        await t.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_a_broken_connection_fails_its_calls_and_the_next_call_reconnects(tmp_path: Path) -> None:
    sock = tmp_path / "p.sock"
    conns: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(1)
        call_id, _, _ = await read_frame(reader)
        if len(conns) == 1:
            writer.close()  # drop the first connection without answering
            return
        ans = peer_pb2.HeartbeatResponse(instance_id="again")
        writer.write(answer_frame(call_id, grpc.StatusCode.OK, answer=ans.SerializeToString()))
        await writer.drain()
        writer.close()

    async def main() -> None:
        server = await _serve(sock, handler)
        t = LocalTransport(str(sock))
        with pytest.raises(RpcFailure) as err:
            await t("Heartbeat", peer_pb2.HeartbeatRequest(), timeout=5, metadata=())
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        ok = await t("Heartbeat", peer_pb2.HeartbeatRequest(), timeout=5, metadata=())
        assert ok.instance_id == "again" and len(conns) == 2
        await t.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_no_socket_is_unavailable(tmp_path: Path) -> None:
    async def main() -> None:
        t = LocalTransport(str(tmp_path / "missing.sock"))
        with pytest.raises(RpcFailure) as err:
            await t("Heartbeat", peer_pb2.HeartbeatRequest(), timeout=1, metadata=())
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        await t.close()

    asyncio.run(main())


def test_a_call_the_socket_cannot_send_goes_over_grpc_and_the_socket_is_dropped(
    tmp_path: Path,
) -> None:
    """An owner that died leaves its socket refusing connections; the call must still reach
    whoever answers at the peer's gRPC address (a restarted owner, which asks for a new
    handshake), and later calls must not try the dead socket again."""
    from kvxferd.wire.peer_client import FakeTransport, PeerClient

    async def answer(method: str, request: object, metadata: object) -> object:
        return peer_pb2.HeartbeatResponse(instance_id=f"grpc:{method}")

    async def main() -> None:
        grpc_side = FakeTransport(answer)
        client = PeerClient("127.0.0.1:1", grpc_side)
        await client.use_local(LocalTransport(str(tmp_path / "dead.sock")))
        resp = await client.heartbeat(peer_pb2.HeartbeatRequest(), 5)
        assert resp.instance_id == "grpc:Heartbeat" and client.local is None
        await client.close()

    asyncio.run(main())


def test_pairs_kept_per_connection_still_refuse_bad_metadata() -> None:
    """Each side keeps the last metadata it encoded or decoded (a connection repeats its own):
    the kept answer is the one a fresh encoding gives, a list is encoded like a tuple, and
    metadata that does not decode is refused at every call, not only the first."""
    pairs = (("authorization", "Bearer y"), ("kvxferd-session", "s1"), ("k-bin", b"\xff"))
    raw = encode_pairs(pairs)
    assert encode_pairs(pairs) is raw  # kept
    assert encode_pairs(list(pairs)) == raw
    assert decode_pairs(raw) == pairs and decode_pairs(raw) is decode_pairs(raw)
    big = (("authorization", "Bearer " + "z" * 2000),)
    assert decode_pairs(encode_pairs(big)) == big  # too big to keep: decoded each time
    for _ in range(2):
        with pytest.raises(FrameError):
            decode_pairs(b'[["k", 1]]')
