"""The scheduler socket between real daemons (``server.scheduler_socket``;
kvxferd/service/local_peer.py, kvxferd/wire/scheduler_socket.py): StartPull with ``wait`` and
the other unary Scheduler calls answer on it exactly as on gRPC (the same status, codes and error
details), the token is checked, and a confused or hostile caller gets a clear refusal, never a
crashed daemon."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import struct
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvxferd.client import AsyncSchedulerClient, KvxferdRpcError, SchedulerClient
from kvxferd.client.values import TransferState
from kvxferd.scenario.client import DaemonClient
from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import scheduler_pb2
from kvxferd.wire.peer_client import RpcFailure
from kvxferd.wire.scheduler_socket import SchedulerSocket
from tests.service.conftest import Daemons, launch, raw_exchange

TOKEN = "s3cret-sched"
MD = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemons, str]]:
    tmp = tmp_path_factory.mktemp("sched")
    path = str(tmp / "decode.sched.sock")  # DaemonOptions.scheduler_socket names it so
    ds = launch(
        tmp,
        DaemonOptions("prefill", "dense:num_blocks=32", fill_seed=5, token=TOKEN),
        DaemonOptions("decode", "dense:num_blocks=32", token=TOKEN, scheduler_socket=True),
    )
    yield ds, path
    ds.stop()


def _clients(ds: Daemons) -> tuple[DaemonClient, SchedulerClient, SchedulerClient]:
    pre, dec = ds["prefill"], ds["decode"]
    ready = ds.set["decode"].ready
    assert ready is not None
    prefill = DaemonClient("prefill", pre.grpc, pre.engine_socket, TOKEN)
    over_grpc = SchedulerClient(dec.grpc, token=TOKEN, timeout_s=10)
    over_socket = SchedulerClient(
        dec.grpc, token=TOKEN, timeout_s=10, socket=ready.scheduler_socket
    )
    return prefill, over_grpc, over_socket


def _checksums(ds: Daemons, name: str, ids: list[int]) -> list[bytes]:
    d = ds[name]
    client = DaemonClient(name, d.grpc, d.engine_socket, TOKEN)
    try:
        return client.checksum(0, ids)
    finally:
        client.close()


def test_a_pull_with_wait_on_the_socket_answers_its_terminal_status_and_moves_the_bytes(
    pair: tuple[Daemons, str],
) -> None:
    ds, path = pair
    ready = ds.set["decode"].ready
    assert ready is not None and ready.scheduler_socket == path  # the ready file names it
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660  # owner and group, like the Engine's
    prefill, _, sock = _clients(ds)
    dec = DaemonClient("decode", ds["decode"].grpc, ds["decode"].engine_socket, TOKEN)
    try:
        # Describe tells an engine beside the daemon where the socket is (PoolInfo), so the
        # vLLM connector needs no setting of its own; a daemon without one says "".
        assert dec.describe().scheduler_socket == path
        assert prefill.describe().scheduler_socket == ""
        hold = prefill.hold("sock-1", [np.array([7, 1, 30, 2], np.int64)])
        st = sock.pull(
            request_id="sock-1",
            peer_address=hold.peer_address,
            remote_block_ids=[list(hold.remote_block_ids.groups[0].ids)],
            local_block_ids=[[3, 9, 4, 20]],
            transfer_id="sock-1-pull",
        )
        assert st.state is TransferState.DONE, st.error
        assert st.nbytes > 0
        again = sock.get_transfer("sock-1-pull")
        assert again.state is TransferState.DONE and again.nbytes == st.nbytes
    finally:
        prefill.close()
        dec.close()
        sock.close()
    assert _checksums(ds, "decode", [3, 9, 4, 20]) == _checksums(ds, "prefill", [7, 1, 30, 2])
    # Calls on the socket count in the same series as gRPC calls (the dashboards read them).
    with urllib.request.urlopen(f"http://{ds['decode'].metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    starts = [
        line
        for line in text.splitlines()
        if line.startswith("kvxferd_rpcs_total{")
        and 'service="kvxferd.v1.Scheduler"' in line
        and 'method="StartPull"' in line
        and 'code="OK"' in line
    ]
    assert starts and float(starts[0].rsplit(" ", 1)[1]) >= 1, starts


def _refusal(call: Callable[..., object], *args: object) -> KvxferdRpcError:
    with pytest.raises(KvxferdRpcError) as err:
        call(*args)
    return err.value


def test_refusals_are_the_same_as_over_grpc(pair: tuple[Daemons, str]) -> None:
    ds, _ = pair
    prefill, over_grpc, over_socket = _clients(ds)
    try:
        hold = prefill.hold("sock-2", [np.array([5, 6], np.int64)])
        for ask in (
            lambda c: c.get_transfer("no-such-transfer"),
            lambda c: c.cancel_transfer("no-such-transfer"),
            lambda c: c.start_pull(  # a local block ID past the pool's 32 blocks
                request_id="sock-2",
                peer_address=hold.peer_address,
                remote_block_ids=[list(hold.remote_block_ids.groups[0].ids)],
                local_block_ids=[[1, 99]],
            ),
        ):
            a = _refusal(ask, over_grpc)
            b = _refusal(ask, over_socket)
            assert a.code == b.code and a.code is not grpc.StatusCode.UNKNOWN
            assert a.details == b.details
            assert a.error is not None and a.error == b.error
            assert a.error.fix, a.error  # every refusal says how to fix it
        peers_grpc = over_grpc.list_peers()
        assert [p.address for p in over_socket.list_peers()] == [p.address for p in peers_grpc]
    finally:
        prefill.close()
        over_grpc.close()
        over_socket.close()


def test_the_token_is_checked_on_the_socket(pair: tuple[Daemons, str]) -> None:
    _, path = pair
    s = SchedulerSocket(path)
    req = scheduler_pb2.GetTransferRequest(transfer_id="x")
    try:
        for md in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(RpcFailure) as err:
                s.GetTransfer(req, timeout=5, metadata=md)
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(RpcFailure) as err:
            s.GetTransfer(req, timeout=5, metadata=MD)
        assert err.value.code() is grpc.StatusCode.NOT_FOUND  # past the token check
    finally:
        s.close()


def _request(method: bytes, body: bytes, call_id: int = 4) -> bytes:
    meta = json.dumps([list(MD[0])]).encode()
    head = struct.pack("!HHI", len(method), len(meta), 1_000_000) + method + meta + body
    return struct.pack("!IIB", len(head), call_id, 1) + head


def test_hostile_frames_are_refused_and_the_daemon_serves_on(pair: tuple[Daemons, str]) -> None:
    ds, path = pair
    for method in (b"WatchTransfers", b"Checksum", b"ConfirmLease", b"Nope"):
        got = raw_exchange(path, _request(method, b""))
        assert got[9] == grpc.StatusCode.UNIMPLEMENTED.value[0], method
        assert b"StartPull" in got and b"gRPC port" in got  # what it serves, and where else
    got = raw_exchange(path, _request(b"StartPull", b"\xff\xff\xff"))
    assert got[9] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert b"does not decode as StartPullRequest" in got
    # Over the frame limit, an unknown kind: that call is answered with why (kvxferd/service/
    # local_calls.py; tests/service/test_socket_limits.py has the rest).
    got = raw_exchange(path, struct.pack("!IIB", 1 << 30, 1, 1))
    assert got[9] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and b"-byte limit" in got
    got = raw_exchange(path, struct.pack("!IIB", 0, 1, 9))
    assert got[9] == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"frame kind 9" in got
    assert ds["decode"].alive()  # type: ignore[operator]
    s = SchedulerSocket(path)
    try:
        with pytest.raises(RpcFailure) as err:
            s.GetTransfer(scheduler_pb2.GetTransferRequest(transfer_id="y"), timeout=5, metadata=MD)
        assert err.value.code() is grpc.StatusCode.NOT_FOUND
    finally:
        s.close()


def test_callers_long_inputs_are_answered_with_their_own_status_on_both_paths(
    pair: tuple[Daemons, str],
) -> None:
    # A refusal repeats the caller's input ("no transfer 'x...'"): cut to fit, it still
    # answers NOT_FOUND, never RESOURCE_EXHAUSTED from gRPC's metadata limit or, on the
    # socket, no answer at all (the details' u16 length overflowed).
    ds, path = pair
    _, over_grpc, over_socket = _clients(ds)
    try:
        for client in (over_grpc, over_socket):
            with pytest.raises(KvxferdRpcError) as err:
                client.get_transfer("x" * 70_000)
            assert err.value.code is grpc.StatusCode.NOT_FOUND
            assert "bytes cut" in err.value.details
            assert len(err.value.details.encode()) <= 4096
        # An unknown method of the longest name a frame can carry, before the token check.
        got = raw_exchange(path, _request(b"\x01" * 65_000, b""))
        assert got[9] == grpc.StatusCode.UNIMPLEMENTED.value[0]
        assert b"bytes cut" in got and len(got) < 5000
    finally:
        over_grpc.close()
        over_socket.close()
    assert ds["decode"].alive()  # type: ignore[operator]


def test_metadata_nested_too_deeply_is_invalid_argument(pair: tuple[Daemons, str]) -> None:
    ds, path = pair
    method = b"ListPeers"
    meta = b"[" * 60_000
    head = struct.pack("!HHI", len(method), len(meta), 1_000_000) + method + meta
    got = raw_exchange(path, struct.pack("!IIB", len(head), 4, 1) + head)
    assert got[9] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert b"nested too deeply" in got
    assert ds["decode"].alive()  # type: ignore[operator]


def test_a_caller_that_gives_up_waiting_leaves_the_pull_running(
    pair: tuple[Daemons, str],
) -> None:
    ds, path = pair
    prefill, _, sock = _clients(ds)
    s = SchedulerSocket(path)
    try:
        hold = prefill.hold("sock-3", [np.array([11, 12, 13, 14, 15, 16], np.int64)])
        req = scheduler_pb2.StartPullRequest(
            request_id="sock-3",
            peer_address=hold.peer_address,
            remote_block_ids=hold.remote_block_ids,
            transfer_id="sock-3-pull",
        )
        req.local_block_ids.groups.add().ids.extend([21, 22, 23, 24, 25, 26])
        assert s.StartPull(req, timeout=10, metadata=MD).created
        req.wait = True  # the same pull (wait is not part of its identity), now waited on
        with pytest.raises(RpcFailure) as err:
            s.StartPull(req, timeout=1e-6, metadata=MD)
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        end = time.monotonic() + 20
        st = sock.get_transfer("sock-3-pull")  # the socket again, on a new connection
        while not st.state.terminal and time.monotonic() < end:
            time.sleep(0.05)
            st = sock.get_transfer("sock-3-pull")
        assert st.state is TransferState.DONE, st.error
    finally:
        s.close()
        prefill.close()
        sock.close()


def test_a_daemon_without_the_socket_is_named_in_the_error(tmp_path: Path) -> None:
    client = SchedulerClient("127.0.0.1:1", socket=str(tmp_path / "none.sock"), timeout_s=2)
    try:
        err = _refusal(client.get_transfer, "x")
        assert err.code is grpc.StatusCode.UNAVAILABLE
        assert "server.scheduler_socket" in err.details
    finally:
        client.close()


def test_the_async_client_pulls_on_the_socket_and_shares_one_connection(
    pair: tuple[Daemons, str],
) -> None:
    ds, path = pair
    pre, dec = ds["prefill"], ds["decode"]
    prefill = DaemonClient("prefill", pre.grpc, pre.engine_socket, TOKEN)
    try:
        hold = prefill.hold("sock-async", [np.array([8, 9, 10], np.int64)])
    finally:
        prefill.close()

    async def run() -> tuple[TransferState, list[KvxferdRpcError], int]:
        async with AsyncSchedulerClient(dec.grpc, token=TOKEN, socket=path) as c:
            st = await c.pull(
                request_id="sock-async",
                peer_address=hold.peer_address,
                remote_block_ids=[list(hold.remote_block_ids.groups[0].ids)],
                local_block_ids=[[12, 13, 14]],
                transfer_id="sock-async-pull",
            )
            asks = [c.get_transfer("sock-async-pull") for _ in range(4)]
            asks += [c.get_transfer(f"nope-{i}") for i in range(4)]
            got = await asyncio.gather(*asks, return_exceptions=True)
            refused = [g for g in got if isinstance(g, KvxferdRpcError)]
            done = sum(1 for g in got if not isinstance(g, BaseException) and g.state is st.state)
            assert c._socket is not None and c._socket._transport.connection == 1
            return st.state, refused, done

    state, refused, done = asyncio.run(run())
    assert state is TransferState.DONE
    assert done == 4  # concurrent calls on one connection, each answered
    assert len(refused) == 4 and all(e.code is grpc.StatusCode.NOT_FOUND for e in refused)
    assert _checksums(ds, "decode", [12, 13, 14]) == _checksums(ds, "prefill", [8, 9, 10])
