"""CMA pulls between real daemons (two processes, DRAM pools, real gRPC, the same-host Peer
socket, process_vm_readv): bytes verified by Checksum for the dense, hybrid and MLA presets,
the strategy and its reason in the status and metrics, ``transfer.cma = false`` and
``transfer.strategy = direct`` giving DIRECT with the reason, cancellation mid-copy."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator, Sequence

import pytest
from grpc import aio

from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from kvxferd.wire.codec import group_ids_to_proto
from tests.service.conftest import Daemon, Daemons, launch

DONE = scheduler_pb2.TRANSFER_STATE_DONE
CMA = scheduler_pb2.TRANSFER_STRATEGY_CMA
DIRECT = scheduler_pb2.TRANSFER_STRATEGY_DIRECT
TERMINAL = {
    DONE,
    scheduler_pb2.TRANSFER_STATE_FAILED,
    scheduler_pb2.TRANSFER_STATE_CANCELLED,
    scheduler_pb2.TRANSFER_STATE_EXPIRED,
}
HYBRID = "hybrid:num_blocks=24"
MLA = "mla:num_blocks=32,num_layers=3,latent_dim=64,block_size=4"


def _set(*pairs: str) -> tuple[str, ...]:
    return tuple(x for p in pairs for x in ("--set", p))


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    daemons = launch(
        tmp_path_factory.mktemp("cma"),
        DaemonOptions("prefill", "dense:num_blocks=64", fill_seed=5),
        DaemonOptions("decode", "dense:num_blocks=64"),
        DaemonOptions("off", "dense:num_blocks=64", extra=_set("transfer.cma=false")),
        DaemonOptions("direct", "dense:num_blocks=64", extra=_set("transfer.strategy=direct")),
        DaemonOptions("h-prefill", HYBRID, fill_seed=9),
        DaemonOptions("h-decode", HYBRID, extra=_set("transfer.strategy=kernel")),
        DaemonOptions("m-prefill", MLA, fill_seed=7),
        DaemonOptions("m-decode", MLA),
    )
    yield daemons
    daemons.stop()


class Client:
    """Hold on the owner's engine socket, StartPull on the reader, wait, compare digests."""

    def __init__(self, owner: Daemon, reader: Daemon) -> None:
        self.engine = engine_pb2_grpc.EngineStub(
            aio.insecure_channel(f"unix:{owner.engine_socket}")
        )
        self.owner = scheduler_pb2_grpc.SchedulerStub(aio.insecure_channel(owner.grpc))
        self.reader = scheduler_pb2_grpc.SchedulerStub(aio.insecure_channel(reader.grpc))

    async def start(
        self, rid: str, remote: Sequence[Sequence[int]], local: Sequence[Sequence[int]]
    ) -> str:
        held = await self.engine.Hold(
            engine_pb2.HoldRequest(request_id=rid, block_ids=group_ids_to_proto(list(remote)))
        )
        resp = await self.reader.StartPull(
            scheduler_pb2.StartPullRequest(
                request_id=held.request_id,
                peer_address=held.peer_address,
                remote_block_ids=held.remote_block_ids,
                local_block_ids=group_ids_to_proto(list(local)),
            )
        )
        return str(resp.status.transfer_id)

    async def wait(self, tid: str) -> scheduler_pb2.TransferStatus:
        stream = self.reader.WatchTransfers(scheduler_pb2.WatchTransfersRequest(transfer_ids=[tid]))
        async for msg in stream:
            if msg.status.state in TERMINAL:
                stream.cancel()
                return msg.status
        raise AssertionError("the watch ended without a terminal state")

    async def pull(
        self, rid: str, remote: Sequence[Sequence[int]], local: Sequence[Sequence[int]]
    ) -> scheduler_pb2.TransferStatus:
        return await self.wait(await self.start(rid, remote, local))

    async def same(self, remote: Sequence[Sequence[int]], local: Sequence[Sequence[int]]) -> bool:
        for g, (r, lo) in enumerate(zip(remote, local, strict=True)):
            mine = await self.reader.Checksum(
                scheduler_pb2.ChecksumRequest(group_index=g, block_ids=list(lo))
            )
            theirs = await self.owner.Checksum(
                scheduler_pb2.ChecksumRequest(group_index=g, block_ids=list(r))
            )
            if list(mine.digests) != list(theirs.digests):
                return False
        return True


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def _metrics(d: Daemon) -> str:
    with urllib.request.urlopen(f"http://{d.metrics}/metrics", timeout=10) as r:
        return str(r.read().decode())


@pytest.mark.parametrize(
    ("owner", "reader", "remote", "local"),
    [
        ("prefill", "decode", [[3, 9, 4, 20, 21, 22, 63]], [[7, 1, 30, 2, 3, 4, 0]]),
        ("h-prefill", "h-decode", [[3, 11, 7], [5]], [[14, 0, 9], [2]]),
        ("m-prefill", "m-decode", [[30, 2, 17, 8, 21]], [[1, 29, 4, 13, 0]]),
    ],
    ids=["dense", "hybrid", "mla"],
)
def test_same_host_dram_pull_is_cma_and_byte_exact(
    ds: Daemons, owner: str, reader: str, remote: list[list[int]], local: list[list[int]]
) -> None:
    async def go() -> None:
        c = Client(ds[owner], ds[reader])
        st = await c.pull(f"cma-{owner}", remote, local)
        assert st.state == DONE, st.error.message
        assert st.strategy == CMA, st.strategy_reason
        assert "process_vm_readv" in st.strategy_reason
        pid = ds.set[owner].ready.pid  # type: ignore[union-attr]
        assert st.strategy_reason.endswith(f"owner process {pid}")
        assert st.nbytes > 0
        assert await c.same(remote, local)

    run(go())
    assert 'kvxferd_transfers_total{state="DONE",strategy="CMA"}' in _metrics(ds[reader])


def test_transfer_cma_false_reads_direct_and_says_why(ds: Daemons) -> None:
    async def go() -> None:
        c = Client(ds["prefill"], ds["off"])
        remote, local = [[5, 6, 7]], [[8, 9, 10]]
        st = await c.pull("cma-off", remote, local)
        assert st.state == DONE, st.error.message
        assert st.strategy == DIRECT
        assert "CMA not possible: this daemon's transfer.cma = false" in st.strategy_reason
        assert await c.same(remote, local)

    run(go())


def test_strategy_direct_keeps_meaning_direct(ds: Daemons) -> None:
    async def go() -> None:
        c = Client(ds["prefill"], ds["direct"])
        st = await c.pull("cma-direct", [[11, 12]], [[13, 14]])
        assert st.state == DONE, st.error.message
        assert st.strategy == DIRECT
        assert st.strategy_reason == "forced by transfer.strategy = direct"

    run(go())
