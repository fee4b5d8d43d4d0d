"""The same-host Peer socket between real daemons (kvxferd/service/local_peer.py): pulls use
it and move the right bytes, ``peers.local_socket = off`` keeps every call on gRPC, and a
confused or hostile caller on the socket gets a clear refusal, never a crashed daemon."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import struct
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvxferd.scenario.client import DaemonClient
from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.scenario.puller import DaemonPuller
from kvxferd.v1 import peer_pb2
from kvxferd.wire.local import LocalTransport
from kvxferd.wire.peer_client import RpcFailure
from tests.service.conftest import Daemons, launch, raw_exchange

TOKEN = "s3cret-local"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    ds = launch(
        tmp_path_factory.mktemp("local"),
        DaemonOptions("prefill", "dense:num_blocks=32", fill_seed=5),
        DaemonOptions("decode", "dense:num_blocks=32"),
    )
    yield ds
    ds.stop()


def _socket(ds: Daemons, name: str) -> str:
    ready = ds.set[name].ready
    assert ready is not None
    return ready.peer_socket


def _pull_and_verify(ds: Daemons, token: str = "") -> None:
    pre, dec = ds["prefill"], ds["decode"]
    prefill = DaemonClient("prefill", pre.grpc, pre.engine_socket, token)
    decode = DaemonClient("decode", dec.grpc, dec.engine_socket, token)
    puller = DaemonPuller(prefill, decode)
    try:
        local, remote = np.array([3, 9, 4, 20], np.int64), np.array([7, 1, 30, 2], np.int64)
        out = puller.pull(local, remote)
        assert out.status.nbytes > 0
        assert puller.verify(local, remote, seed=1) == 0
    finally:
        puller.close()
        prefill.close()
        decode.close()


def _peer_calls(log: Path) -> list[str]:
    return [
        line.split('"peer_calls": "')[1].split('"')[0]
        for line in log.read_text().splitlines()
        if '"handshake done"' in line and '"peer_calls"' in line
    ]


def test_same_host_pulls_confirm_over_the_socket_and_move_the_right_bytes(pair: Daemons) -> None:
    path = _socket(pair, "prefill")
    assert path and stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # the daemon's user only
    _pull_and_verify(pair)
    assert _peer_calls(pair["decode"].log) == [f"unix:{path}"]
    # Calls over the socket count in the same series as gRPC calls (the dashboards read them).
    with urllib.request.urlopen(f"http://{pair['decode'].metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    confirms = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvxferd_peer_rpcs_total{")
        and 'method="ConfirmLease"' in line
        and 'code="OK"' in line
    ]
    assert confirms and confirms[0] >= 1, confirms


async def _call(
    path: str, method: str, msg: object, md: tuple[tuple[str, str], ...] = ()
) -> object:
    t = LocalTransport(path)
    try:
        return await t(method, msg, timeout=5, metadata=md)
    finally:
        await t.close()


@pytest.mark.parametrize(
    ("data", "code", "text"),
    [
        (struct.pack("!IIB", 1 << 30, 1, 1), grpc.StatusCode.RESOURCE_EXHAUSTED, b"-byte limit"),
        (struct.pack("!IIB", 0, 1, 9), grpc.StatusCode.INVALID_ARGUMENT, b"frame kind 9"),
    ],
)
def test_a_refused_frame_is_answered_and_touches_only_that_connection(
    pair: Daemons, data: bytes, code: grpc.StatusCode, text: bytes
) -> None:
    path = _socket(pair, "prefill")
    got = raw_exchange(path, data)  # that call is answered with why (then skipped, or closed)
    assert got[9] == code.value[0] and text in got and b"fix:" in got, got
    # The daemon still answers on a new connection and over gRPC.
    with pytest.raises(RpcFailure) as err:
        asyncio.run(_call(path, "Heartbeat", peer_pb2.HeartbeatRequest()))
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    _pull_and_verify(pair)


def test_garbage_request_bodies_are_invalid_argument(pair: Daemons) -> None:
    path = _socket(pair, "prefill")
    short = struct.pack("!IIB", 2, 5, 1) + b"\x00\x07"
    got = raw_exchange(path, short)
    assert got[9] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    name = b"Heartbeat"
    body = struct.pack("!HHI", len(name), 0, 1_000_000) + name + b"\xff\xff\xff"
    got = raw_exchange(path, struct.pack("!IIB", len(body), 6, 1) + body)
    assert got[9] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert b"does not decode as HeartbeatRequest" in got


def test_calls_the_socket_does_not_serve_are_unimplemented(pair: Daemons) -> None:
    path = _socket(pair, "prefill")
    name = b"Handshake"
    body = struct.pack("!HHI", len(name), 0, 1_000_000) + name
    got = raw_exchange(path, struct.pack("!IIB", len(body), 8, 1) + body)
    assert got[9] == grpc.StatusCode.UNIMPLEMENTED.value[0]
    assert b"on the gRPC port" in got


def test_every_call_needs_a_handshake_session(pair: Daemons) -> None:
    path = _socket(pair, "prefill")
    for method, msg in (
        ("ConfirmLease", peer_pb2.ConfirmLeaseRequest(request_id="r")),
        ("ReleaseLease", peer_pb2.ReleaseLeaseRequest(request_id="r", reason=1)),
        ("Heartbeat", peer_pb2.HeartbeatRequest()),
    ):
        with pytest.raises(RpcFailure) as err:
            asyncio.run(_call(path, method, msg, (("kvxferd-session", "00" * 16),)))
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED, method
        assert "session" in err.value.details(), err.value.details()


def test_off_serves_no_socket_and_pulls_use_grpc(tmp_path: Path) -> None:
    off = ("--set", "peers.local_socket=off")
    ds = launch(
        tmp_path,
        DaemonOptions("prefill", "dense:num_blocks=32", fill_seed=5, extra=off),
        DaemonOptions("decode", "dense:num_blocks=32", extra=off),
    )
    try:
        assert _socket(ds, "prefill") == "" and _socket(ds, "decode") == ""
        _pull_and_verify(ds)
        assert _peer_calls(ds["decode"].log) == ["grpc"]
    finally:
        ds.stop()


def test_the_token_is_checked_on_the_socket_as_on_grpc(tmp_path: Path) -> None:
    auth = ("--set", f"auth.token={TOKEN}")
    ds = launch(
        tmp_path,
        DaemonOptions("prefill", "dense:num_blocks=32", fill_seed=5, extra=auth),
        DaemonOptions("decode", "dense:num_blocks=32", extra=auth),
    )
    try:
        path = _socket(ds, "prefill")
        with pytest.raises(RpcFailure) as err:
            asyncio.run(_call(path, "Heartbeat", peer_pb2.HeartbeatRequest()))
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "missing token" in err.value.details()
        with pytest.raises(RpcFailure) as err:
            bad = (("authorization", "Bearer nope"),)
            asyncio.run(_call(path, "Heartbeat", peer_pb2.HeartbeatRequest(), bad))
        assert "wrong token" in err.value.details()
        _pull_and_verify(ds, TOKEN)
        assert _peer_calls(ds["decode"].log) == [f"unix:{path}"]
    finally:
        ds.stop()
    assert not Path(path).exists()  # removed on shutdown


def test_sockets_of_dead_daemons_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    from kvxferd.service.local_peer import sweep_stale

    dead = tmp_path / "kvxferd-peer-dead.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(dead))  # bound, never listening: what a killed daemon leaves
    live = tmp_path / "kvxferd-peer-live.sock"
    other = tmp_path / "something-else.sock"
    with socket.socket(socket.AF_UNIX) as srv, socket.socket(socket.AF_UNIX) as o:
        srv.bind(str(live))
        srv.listen(1)
        o.bind(str(other))
        assert sweep_stale(str(tmp_path)) == [str(dead)]
        assert live.exists() and other.exists() and not dead.exists()


def test_a_path_another_daemon_serves_is_not_taken_over(tmp_path: Path) -> None:
    """Two daemons configured with one peers.local_socket path: the second does not steal the
    first's socket (it serves gRPC only); a socket left by a dead daemon is replaced."""
    from prometheus_client import CollectorRegistry

    from kvxferd.metrics import Metrics
    from kvxferd.service.local_peer import LocalPeerServer

    path = str(tmp_path / "peer.sock")
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(path)  # what a killed daemon leaves

    async def main() -> None:
        metrics = Metrics.create(CollectorRegistry())
        first = LocalPeerServer(object(), metrics, path)
        await first.start()  # replaces the dead socket
        second = LocalPeerServer(object(), metrics, path)
        with pytest.raises(OSError, match="another process serves"):
            await second.start()
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        name = b"Handshake"  # still the first one's socket: it answers
        body = struct.pack("!HHI", len(name), 0, 1_000_000) + name
        got = await asyncio.to_thread(
            raw_exchange, path, struct.pack("!IIB", len(body), 1, 1) + body
        )
        assert got[9] == grpc.StatusCode.UNIMPLEMENTED.value[0]
        await first.close()
        assert not os.path.exists(path)

    asyncio.run(main())
