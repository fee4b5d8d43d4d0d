"""A decode daemon's engine detaches while pulls into its pool are in flight (real daemons, a real
engine process): the Detach returns only once every pull into the pool has ended, so nothing
writes into the pool's memory after it is dropped (kvxferd/daemon/quiesce.py). A pull the
detach stopped ends CANCELLED, saying the pool went away and what to do."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc import aio

from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import engine_pb2, engine_pb2_grpc, peer_pb2, scheduler_pb2, scheduler_pb2_grpc
from kvxferd.wire.codec import group_ids_to_proto
from tests.attach.test_attach import TERMINAL, Engine
from tests.service.conftest import Daemon, Daemons, launch
from tests.service.raw_peer import handshake

BLOCKS = 256  # dense: 2 MiB per block, 512 MiB per pool


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    """A filled prefill daemon, and a decode daemon whose pool an engine attaches."""
    spec = f"dense:num_blocks={BLOCKS}"
    ds = launch(
        tmp_path_factory.mktemp("detach-pulls"),
        DaemonOptions("prefill", spec, fill_seed=4),
        DaemonOptions("decode", spec, extra=("--set", "pool.mode=attached")),
    )
    yield ds
    ds.stop()


def _sched(d: Daemon) -> scheduler_pb2_grpc.SchedulerStub:
    return scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(d.grpc))


def _hold(prefill: Daemon, rid: str, ids: list[int]) -> engine_pb2.HoldResponse:
    stub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(f"unix:{prefill.engine_socket}"))
    return stub.Hold(engine_pb2.HoldRequest(request_id=rid, block_ids=group_ids_to_proto([ids])))


def _start(decode: Daemon, held: engine_pb2.HoldResponse, local: list[int]) -> str:
    st = _sched(decode).StartPull(
        scheduler_pb2.StartPullRequest(
            request_id=held.request_id,
            peer_address=held.peer_address,
            remote_block_ids=held.remote_block_ids,
            local_block_ids=group_ids_to_proto([local]),
            deadline_ms=60_000,
        )
    )
    return str(st.status.transfer_id)


def _status(decode: Daemon, tid: str) -> scheduler_pb2.TransferStatus:
    return _sched(decode).GetTransfer(scheduler_pb2.GetTransferRequest(transfer_id=tid)).status


def _wait(decode: Daemon, tid: str, states: set[int]) -> scheduler_pb2.TransferStatus:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        st = _status(decode, tid)
        if st.state in states or st.state in TERMINAL:
            return st
        time.sleep(0.002)
    raise AssertionError(f"transfer {tid} never reached {states}")


def test_a_detach_ends_a_pull_still_waiting_for_its_lease_confirmation(daemons: Daemons) -> None:
    # The owner is stopped (SIGSTOP: a stalled peer, for real) once the link is up, so the
    # pull waits for its confirmation when the engine detaches. Before the fix the pull
    # outlived the detach, still CONFIRMING, and would have posted into the next pool.
    prefill, decode = daemons["prefill"], daemons["decode"]
    eng = Engine(decode.engine_socket, "--preset", "dense:num_blocks=16")
    owner = daemons.set["prefill"].proc
    assert owner is not None
    try:
        eng.line()
        warm = _wait(decode, _start(decode, _hold(prefill, "warm", [1, 2]), [5, 6]), set())
        assert warm.state == scheduler_pb2.TRANSFER_STATE_DONE, warm.error.message
        held = _hold(prefill, "stalled", [3, 4])
        os.kill(owner.pid, signal.SIGSTOP)
        try:
            tid = _start(decode, held, [7, 8])
            assert _status(decode, tid).state == scheduler_pb2.TRANSFER_STATE_CONFIRMING
            eng.detach()
            st = _status(decode, tid)
        finally:
            os.kill(owner.pid, signal.SIGCONT)
    finally:
        eng.kill()
    assert st.state == scheduler_pb2.TRANSFER_STATE_CANCELLED, st
    assert "pool went away (the engine detached" in st.error.message, st.error
    assert "no local block was written" in st.error.message
    assert "attached its pool" in st.error.fix
    assert not st.invalid_local_block_ids.groups


def test_a_detach_returns_only_once_a_running_pull_has_ended(daemons: Daemons) -> None:
    # A 512 MiB pull is copying (TRANSFERRING) when the engine detaches: the Detach's answer
    # comes after the pull's end, which lists every local block it may have written.
    prefill, decode = daemons["prefill"], daemons["decode"]
    eng = Engine(decode.engine_socket, "--preset", f"dense:num_blocks={BLOCKS}")
    try:
        eng.line()
        ids = list(range(BLOCKS))
        local = ids[::-1]
        tid = _start(decode, _hold(prefill, "big", ids), local)
        st = _wait(decode, tid, {scheduler_pb2.TRANSFER_STATE_TRANSFERRING})
        if st.state in TERMINAL:
            pytest.fail(f"the pull ended before the detach could meet it: {st}")
        eng.detach()
        detached_ns = time.time_ns()
        st = _status(decode, tid)
    finally:
        eng.kill()
    assert st.state in TERMINAL, st  # ended before the Detach answered
    assert 0 < st.finished_unix_ns <= detached_ns
    if st.state == scheduler_pb2.TRANSFER_STATE_CANCELLED:
        assert "pool went away" in st.error.message, st.error
        (listed,) = st.invalid_local_block_ids.groups
        assert sorted(listed.ids) == ids
    else:
        assert st.state == scheduler_pb2.TRANSFER_STATE_DONE, st.error  # it won the race


def test_a_gather_while_no_engine_is_attached_says_the_engine_detached(tmp_path: Path) -> None:
    # A reader that handshook while an engine was attached asks a STAGED owner to gather after
    # the engine went away: the answer says so (UNAVAILABLE, a re-attach awaited), not that the
    # daemon has no staging ring and its configuration should change.
    staged = ("--set", "pool.mode=attached", "--set", "transfer.strategy=staged")
    ds = launch(tmp_path, DaemonOptions("att", "dense:num_blocks=64", extra=staged))
    try:
        att = ds["att"]
        eng = Engine(att.engine_socket)

        async def gather() -> aio.AioRpcError:
            peer = await handshake(att.grpc, "dense:num_blocks=64", agent="raw-reader")
            await asyncio.to_thread(eng.detach)
            with pytest.raises(aio.AioRpcError) as ei:
                await peer.stub.Gather(
                    peer_pb2.GatherRequest(
                        request_id="req-0", kernel_block_ids=group_ids_to_proto([[0]])
                    ),
                    metadata=peer.md,
                    timeout=10,
                )
            return ei.value

        try:
            eng.line()
            err = asyncio.run(gather())
        finally:
            eng.kill()
    finally:
        ds.stop()
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
    text = err.details() or ""
    assert "serves no KV pool: the engine called Detach" in text and "staging_chunks" not in text
