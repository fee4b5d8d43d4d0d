"""kvxferd.client: the scheduler client against live daemons, its retries, its footprint.

* sync and async clients start, watch, get, cancel pulls, list peers and compare checksums
  through two real daemons; a refused call raises KvxferdRpcError with the daemon's error;
* idempotent calls are retried on UNAVAILABLE by gRPC's service config (a fake Scheduler
  that fails twice);
* ``import kvxferd.client`` loads neither torch, numpy nor NIXL;
* the ``.proto`` files ship inside the built wheel and equal proto/.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from kvxferd.client import (
    AsyncSchedulerClient,
    KvxferdRpcError,
    PeerState,
    SchedulerClient,
    TransferState,
    TransferStrategy,
    proto_files,
)
from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import common_pb2, engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.service.conftest import Daemons, launch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    ds = launch(
        tmp_path_factory.mktemp("client"),
        DaemonOptions("prefill", "dense:num_blocks=64", fill_seed=11),
        DaemonOptions("decode", "dense:num_blocks=64"),
    )
    yield ds
    ds.stop()


def _hold(ds: Daemons, rid: str, ids: list[int]) -> engine_pb2.HoldResponse:
    with grpc.insecure_channel(f"unix:{ds['prefill'].engine_socket}") as ch:
        resp: engine_pb2.HoldResponse = engine_pb2_grpc.EngineStub(ch).Hold(
            engine_pb2.HoldRequest(
                request_id=rid,
                block_ids=common_pb2.GroupBlockIds(groups=[common_pb2.BlockIds(ids=ids)]),
            ),
            timeout=10,
        )
    return resp


def test_sync_client_pulls_and_verifies(pair: Daemons) -> None:
    held = _hold(pair, "client-sync", [4, 5, 6, 30])
    remote = [list(g.ids) for g in held.remote_block_ids.groups]
    with (
        SchedulerClient(pair["decode"].grpc) as decode,
        SchedulerClient(pair["prefill"].grpc) as prefill,
    ):
        started = decode.start_pull(
            request_id=held.request_id,
            peer_address=held.peer_address,
            remote_block_ids=remote,
            local_block_ids=[[40, 41, 42, 43]],
        )
        assert started.created and started.status.transfer_id
        again = decode.start_pull(  # what a retry sends: the same transfer_id
            request_id=held.request_id,
            peer_address=held.peer_address,
            remote_block_ids=remote,
            local_block_ids=[[40, 41, 42, 43]],
            transfer_id=started.status.transfer_id,
        )
        assert not again.created
        status = decode.wait(started.status.transfer_id, timeout_s=30)
        assert status.state is TransferState.DONE, status.error
        # Both daemons on this host with host-memory pools: auto reads CMA (docs/strategies.md).
        assert status.strategy is TransferStrategy.CMA, status.strategy_reason
        assert status.nbytes > 0 and status.terminal and status.error is None
        assert decode.get_transfer(status.transfer_id).state is TransferState.DONE
        assert decode.checksum(0, [40, 41, 42, 43]) == prefill.checksum(0, [4, 5, 6, 30])
        (peer,) = decode.list_peers()
        assert peer.address == held.peer_address and peer.state is PeerState.READY
        seen = list(decode.watch_transfers([status.transfer_id]))
        assert seen[-1].state is TransferState.DONE
        assert decode.cancel_transfer(status.transfer_id).state is TransferState.DONE
        with pytest.raises(KvxferdRpcError) as ei:
            decode.get_transfer("no-such-transfer")
        assert ei.value.code == grpc.StatusCode.NOT_FOUND
        assert ei.value.error is not None and ei.value.error.kind == "NOT_FOUND"
        assert ei.value.error.field == "transfer_id"
        with pytest.raises(KvxferdRpcError) as ei:
            decode.checksum(0, [10_000])
        assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_async_client_pulls_and_cancels(pair: Daemons) -> None:
    held = _hold(pair, "client-async", [7, 8])
    remote = [list(g.ids) for g in held.remote_block_ids.groups]

    async def go() -> None:
        async with AsyncSchedulerClient(pair["decode"].grpc) as decode:
            started = await decode.start_pull(
                request_id=held.request_id,
                peer_address=held.peer_address,
                remote_block_ids=remote,
                local_block_ids=[[50, 51]],
            )
            status = await decode.wait(started.status.transfer_id, timeout_s=30)
            assert status.state is TransferState.DONE, status.error
            assert (await decode.get_transfer(status.transfer_id)).nbytes == status.nbytes
            peers = await decode.list_peers()
            assert [p.state for p in peers] == [PeerState.READY]
            async for st in decode.watch_transfers([status.transfer_id]):
                last = st
            assert last.state is TransferState.DONE
            digests = await decode.checksum(0, [50, 51])
            assert len(digests) == 2
            # A pull of a request the owner does not hold fails, with the daemon's reason.
            bad = await decode.start_pull(
                request_id="never-held",
                peer_address=held.peer_address,
                remote_block_ids=[[1]],
                local_block_ids=[[2]],
            )
            failed = await decode.wait(bad.status.transfer_id, timeout_s=30)
            assert failed.state is TransferState.FAILED
            assert failed.error is not None and failed.error.message

    asyncio.run(go())


def test_pull_returns_the_terminal_status_in_one_call(pair: Daemons) -> None:
    """``pull`` (StartPull with wait): DONE with the bytes in place, FAILED returned not raised,
    a bad request raised at once; sync and async."""
    held = _hold(pair, "client-pull", [9, 10, 11])
    remote = [list(g.ids) for g in held.remote_block_ids.groups]
    with (
        SchedulerClient(pair["decode"].grpc) as decode,
        SchedulerClient(pair["prefill"].grpc) as prefill,
    ):
        done = decode.pull(
            request_id=held.request_id,
            peer_address=held.peer_address,
            remote_block_ids=remote,
            local_block_ids=[[20, 21, 22]],
        )
        assert done.state is TransferState.DONE and done.terminal, done.error
        assert done.stages and done.stages[0][0] == "decode"
        assert decode.checksum(0, [20, 21, 22]) == prefill.checksum(0, [9, 10, 11])
        with pytest.raises(KvxferdRpcError) as ei:
            decode.pull(
                request_id=held.request_id,
                peer_address=held.peer_address,
                remote_block_ids=remote,
                local_block_ids=[[20, 21, 10_000]],
            )
        assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT

    held = _hold(pair, "client-pull-async", [12, 13])

    async def go() -> None:
        async with AsyncSchedulerClient(pair["decode"].grpc) as decode:
            status = await decode.pull(
                request_id=held.request_id,
                peer_address=held.peer_address,
                remote_block_ids=[list(g.ids) for g in held.remote_block_ids.groups],
                local_block_ids=[[23, 24]],
            )
            assert status.state is TransferState.DONE, status.error
            failed = await decode.pull(
                request_id="never-held-pull",
                peer_address=held.peer_address,
                remote_block_ids=[[1]],
                local_block_ids=[[2]],
            )
            assert failed.state is TransferState.FAILED
            assert failed.error is not None and failed.error.message

    asyncio.run(go())


class _Flaky(scheduler_pb2_grpc.SchedulerServicer):
    """GetTransfer fails UNAVAILABLE twice, then answers; StartPull always fails."""

    def __init__(self) -> None:
        self.calls = 0

    def GetTransfer(  # noqa: N802 (the servicer's method name)
        self, request: scheduler_pb2.GetTransferRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.GetTransferResponse:
        self.calls += 1
        if self.calls <= 2:
            context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        return scheduler_pb2.GetTransferResponse(
            status=scheduler_pb2.TransferStatus(
                transfer_id=request.transfer_id, state=scheduler_pb2.TRANSFER_STATE_DONE
            )
        )


def test_idempotent_calls_are_retried_by_the_service_config() -> None:
    flaky = _Flaky()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(flaky, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with SchedulerClient(f"127.0.0.1:{port}", timeout_s=10) as client:
            assert client.get_transfer("t").state is TransferState.DONE
        assert flaky.calls == 3
        flaky.calls = 0
        with (
            SchedulerClient(f"127.0.0.1:{port}", retry=False) as client,
            pytest.raises(KvxferdRpcError) as ei,
        ):
            client.get_transfer("t")
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE and flaky.calls == 1

        async def go() -> None:
            flaky.calls = 0
            async with AsyncSchedulerClient(f"127.0.0.1:{port}") as client:
                assert (await client.get_transfer("t")).state is TransferState.DONE
            assert flaky.calls == 3

        asyncio.run(go())
    finally:
        server.stop(None)


def test_client_imports_without_torch_numpy_or_nixl() -> None:
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numpy", "nixl", "nixl_cu13", "nixl_cu12"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import kvxferd.client as c
c.SchedulerClient("127.0.0.1:1").close()
assert not [m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "nixl_cu13")]
print("ok")
"""
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


def test_protos_ship_in_the_package_and_the_wheel(tmp_path: Path) -> None:
    shipped = proto_files()
    source = {
        f"kvxferd/v1/{p.name}": p.read_text() for p in (ROOT / "proto/kvxferd/v1").glob("*.proto")
    }
    assert shipped == source and "kvxferd/v1/scheduler.proto" in shipped
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    (wheel,) = tmp_path.glob("kvxferd-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for path in source:
        assert f"kvxferd/proto/{path}" in names, path
    assert "kvxferd/client/__init__.py" in names


def test_the_client_names_every_strategy_the_proto_has() -> None:
    """A status from a newer daemon must not read as UNSPECIFIED for a strategy the proto
    names (TransferStatus.strategy)."""
    for name, number in scheduler_pb2.TransferStrategy.items():
        assert TransferStrategy.of(number).value == number, name
