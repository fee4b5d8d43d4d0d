"""Issue 11 regressions about peers, through real daemons: identity, restarts, bounded links."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path

import grpc
import pytest
from grpc import aio

from kvxferd.scenario.daemons import DaemonOptions, DaemonSet
from kvxferd.scenario.ports import free_port
from kvxferd.v1 import engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from kvxferd.wire.codec import group_ids_to_proto
from tests.service.conftest import Daemon, launch
from tests.service.test_safety import HB
from tests.service.test_service_pull import Client, run

SPEC = "dense:num_blocks=64"
DONE = scheduler_pb2.TRANSFER_STATE_DONE


async def pull_verified(
    owner: Daemon, reader: Daemon, rid: str, remote: list[int], local: list[int], *, via: str = ""
) -> None:
    c = Client(owner, reader)
    held = await c.hold(rid, remote)
    if via:
        held.peer_address = via
    st = await c.pull(held, local)
    done = await c.wait(st.transfer_id)
    assert done.state == DONE, done.error.message
    assert await c.digests(c.decode, local) == await c.digests(c.prefill, remote)


@pytest.mark.slow
def test_reverse_and_aliased_handshakes_disturb_no_pull(tmp_path: Path) -> None:
    """Prefill pulls from decode while decode pulls from prefill, and decode reaches prefill
    under two spellings of its address at once: every pull completes with the right bytes."""
    ds = launch(
        tmp_path,
        DaemonOptions("a", SPEC, fill_seed=21, extra=HB),
        DaemonOptions("b", SPEC, fill_seed=22, extra=HB),
    )
    try:
        a, b = ds["a"], ds["b"]
        port = a.grpc.rpartition(":")[2]

        async def go() -> None:
            for rnd in range(3):
                await asyncio.gather(
                    pull_verified(a, b, f"fwd-{rnd}", [1, 2, 3], [10, 11, 12]),
                    pull_verified(a, b, f"alias-{rnd}", [4, 5], [13, 14], via=f"localhost:{port}"),
                    pull_verified(b, a, f"rev-{rnd}", [7, 8, 9], [40, 41, 42]),
                )

        run(go())
    finally:
        ds.stop()


@pytest.mark.slow
def test_a_restarted_owner_is_handshaken_again_before_the_first_read(tmp_path: Path) -> None:
    """prefill SIGKILLed and restarted on the same address (new instance, new memory): the
    first pull afterwards is DONE with the new instance's bytes, not FAILED on stale metadata."""
    port = free_port()
    (tmp_path / "d").mkdir()
    decode = launch(tmp_path / "d", DaemonOptions("decode", SPEC, extra=HB))

    def prefill(workdir: Path, seed: int) -> DaemonSet:
        workdir.mkdir(parents=True, exist_ok=True)
        opts = DaemonOptions(
            "prefill", SPEC, fill_seed=seed, extra=(*HB, "--listen", f"127.0.0.1:{port}")
        )
        ds = DaemonSet(workdir, [opts])
        ds.start()
        ds.wait_ready()
        return ds

    def view(ds: DaemonSet) -> Daemon:
        d = ds["prefill"]
        assert d.ready is not None
        return Daemon(d.ready.grpc, d.ready.engine_socket, d.ready.metrics, d.alive, d.log_path)

    first = prefill(tmp_path / "p1", seed=31)
    second: DaemonSet | None = None
    try:
        run(pull_verified(view(first), decode["decode"], "before", [1, 2], [3, 4]))
        pid = first["prefill"].ready.pid  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)
        first["prefill"].proc.wait(10)  # type: ignore[union-attr]
        second = prefill(tmp_path / "p2", seed=32)
        run(pull_verified(view(second), decode["decode"], "after", [1, 2], [5, 6]))
    finally:
        first.stop()
        if second is not None:
            second.stop()
        decode.stop()


@pytest.mark.slow
def test_dead_addresses_do_not_grow_the_peer_directory(tmp_path: Path) -> None:
    ds = launch(
        tmp_path,
        DaemonOptions("prefill", SPEC, fill_seed=41),
        DaemonOptions(
            "decode",
            SPEC,
            extra=("--set", "peers.max_links=4", "--set", "transfer.handshake_timeout_ms=300"),
        ),
    )
    try:

        async def go() -> None:
            sched = scheduler_pb2_grpc.SchedulerStub(aio.insecure_channel(ds["decode"].grpc))
            eng = engine_pb2_grpc.EngineStub(
                aio.insecure_channel(f"unix:{ds['prefill'].engine_socket}")
            )
            held = await eng.Hold(
                engine_pb2.HoldRequest(request_id="dead", block_ids=group_ids_to_proto([[1]]))
            )
            for i in range(30):
                with pytest.raises(aio.AioRpcError) as ei:
                    await sched.StartPull(
                        scheduler_pb2.StartPullRequest(
                            request_id="dead",
                            peer_address=f"127.0.0.1:{1 + i}",
                            remote_block_ids=held.remote_block_ids,
                            local_block_ids=group_ids_to_proto([[1]]),
                        )
                    )
                assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value.details()
            peers = await sched.ListPeers(scheduler_pb2.ListPeersRequest())
            assert len(peers.peers) <= 4
            await pull_verified(ds["prefill"], ds["decode"], "alive", [2, 3], [4, 5])

        run(go())
    finally:
        ds.stop()


def test_a_handshake_a_pull_gave_up_on_is_not_listed_in_progress(tmp_path: Path) -> None:
    """A peer that accepts TCP and never answers: the pull's deadline (0.5 s) ends the pull
    DEADLINE_EXCEEDED during the handshake (whose own timeout is 5 s). Past it no handshake is
    in progress, so ListPeers must not say CONNECTING ("Handshake in progress") but
    UNREACHABLE, with why."""
    ds = launch(tmp_path, DaemonOptions("decode", SPEC))
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)  # accepts, never answers
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    try:

        async def go() -> None:
            sched = scheduler_pb2_grpc.SchedulerStub(aio.insecure_channel(ds["decode"].grpc))
            with pytest.raises(aio.AioRpcError) as ei:
                await sched.StartPull(
                    scheduler_pb2.StartPullRequest(
                        request_id="silent",
                        peer_address=address,
                        remote_block_ids=group_ids_to_proto([[1]]),
                        local_block_ids=group_ids_to_proto([[1]]),
                        deadline_ms=500,
                    )
                )
            assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ei.value.details()
            peers = await sched.ListPeers(scheduler_pb2.ListPeersRequest())
            (peer,) = [p for p in peers.peers if p.address == address]
            assert peer.handshake_state == scheduler_pb2.HANDSHAKE_STATE_UNREACHABLE
            assert "gave up" in peer.last_error.message

        run(go())
    finally:
        silent.close()
        ds.stop()
