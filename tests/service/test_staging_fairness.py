"""Issue 11 item 5 through real daemons: one reader cannot take a daemon's whole staging ring.

A greedy reader (a raw peer with a handshake session of its own and a confirmed, heartbeated
share of its lease) asks the prefill daemon's 4-slot ring for every slot (and more) with raw
``Peer.Gather`` calls and never gives any back. The owner grants it its cap (half the ring,
2 slots); its other Gathers wait for *its own* slots, so a real decode daemon's STAGED pull
still gets slots and completes byte-exact well inside a short deadline. The greedy reader's
extra Gathers end RESOURCE_EXHAUSTED with a message naming the cap and a fix, and a slot it
releases goes to its own waiting Gather.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import grpc
import pytest
from grpc import aio

from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    peer_pb2,
    peer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from kvxferd.wire.codec import group_ids_to_proto
from tests.service.conftest import Daemons, launch
from tests.service.raw_peer import handshake

ROW = 32 * 65536  # one dense block row: 32 layers x 64 KiB
TERMINAL = {
    scheduler_pb2.TRANSFER_STATE_DONE,
    scheduler_pb2.TRANSFER_STATE_FAILED,
    scheduler_pb2.TRANSFER_STATE_CANCELLED,
    scheduler_pb2.TRANSFER_STATE_EXPIRED,
}


def _staging(strategy: str, chunks: int) -> tuple[str, ...]:
    return (
        "--set",
        f"transfer.strategy={strategy}",
        "--set",
        f"transfer.staging_chunk_bytes={2 * ROW}",
        "--set",
        f"transfer.staging_chunks={chunks}",
    )


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    """A prefill daemon with a 4-slot ring (2 slots per reader) and a decode daemon forced
    STAGED."""
    ds = launch(
        tmp_path_factory.mktemp("fairness"),
        DaemonOptions("prefill", "dense:num_blocks=64", fill_seed=11, extra=_staging("auto", 4)),
        DaemonOptions("decode", "dense:num_blocks=64", extra=_staging("staged", 4)),
    )
    yield ds
    ds.stop()


def _ids(ids: Sequence[int]) -> common_pb2.GroupBlockIds:
    return common_pb2.GroupBlockIds(groups=[common_pb2.BlockIds(ids=list(ids))])


@pytest.mark.slow
def test_a_reader_at_its_cap_cannot_starve_a_staged_pull(daemons: Daemons) -> None:
    async def go() -> None:
        prefill, decode = daemons["prefill"], daemons["decode"]
        engine = engine_pb2_grpc.EngineStub(aio.insecure_channel(f"unix:{prefill.engine_socket}"))
        peer = peer_pb2_grpc.PeerStub(aio.insecure_channel(prefill.grpc))
        dec = scheduler_pb2_grpc.SchedulerStub(aio.insecure_channel(decode.grpc))
        pre = scheduler_pb2_grpc.SchedulerStub(aio.insecure_channel(prefill.grpc))
        raw = await handshake(prefill.grpc, "dense:num_blocks=64", agent="greedy")
        greedy = raw.md

        # The greedy reader: a held request of its own, then Gathers for the whole ring and
        # more, none ever released.
        await engine.Hold(
            engine_pb2.HoldRequest(request_id="greedy-req", block_ids=_ids(range(40, 48)))
        )
        await raw.confirm("greedy-req")

        async def stay_alive() -> None:  # a live reader heartbeats; its share never lapses
            while True:
                await raw.heartbeat(["greedy-req"], 5_000)
                await asyncio.sleep(0.5)

        alive = asyncio.ensure_future(stay_alive())

        async def greedy_gather(block: int, timeout: float) -> peer_pb2.GatherResponse:
            resp: peer_pb2.GatherResponse = await peer.Gather(
                peer_pb2.GatherRequest(
                    request_id="greedy-req", reader_id="greedy", kernel_block_ids=_ids([block])
                ),
                timeout=timeout,
                metadata=greedy,
            )
            return resp

        granted = [await greedy_gather(40, 5), await greedy_gather(41, 5)]  # its cap: 2 of 4
        extra = [asyncio.ensure_future(greedy_gather(42 + i, 6)) for i in range(4)]
        await asyncio.sleep(0.3)
        assert not any(t.done() for t in extra), "a reader got more than half the ring"

        # Meanwhile a real STAGED pull of 10 rows (5 chunks) through the 2 slots left.
        remote, local = [3, 17, 29, 8, 55, 61, 0, 12, 33, 26], list(range(20, 30))
        held = await engine.Hold(
            engine_pb2.HoldRequest(request_id="fair-pull", block_ids=_ids(remote))
        )
        start = await dec.StartPull(
            scheduler_pb2.StartPullRequest(
                request_id=held.request_id,
                peer_address=held.peer_address,
                remote_block_ids=held.remote_block_ids,
                local_block_ids=_ids(local),
                deadline_ms=5000,  # the greedy reader's grants would last 30 s
            )
        )
        stream = dec.WatchTransfers(
            scheduler_pb2.WatchTransfersRequest(transfer_ids=[start.status.transfer_id])
        )
        status = None
        async for msg in stream:
            if msg.status.state in TERMINAL:
                status = msg.status
                stream.cancel()
                break
        assert status is not None
        assert status.state == scheduler_pb2.TRANSFER_STATE_DONE, status.error.message
        assert status.strategy == scheduler_pb2.TRANSFER_STRATEGY_STAGED, status.strategy_reason
        assert status.stage_times.chunks == 5
        for lo, r in zip(local, remote, strict=True):
            got = await dec.Checksum(scheduler_pb2.ChecksumRequest(group_index=0, block_ids=[lo]))
            want = await pre.Checksum(scheduler_pb2.ChecksumRequest(group_index=0, block_ids=[r]))
            assert got.digests == want.digests, (lo, r)

        # The slots the pull gave back did not go to the greedy reader: it is still at its cap.
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in extra)

        # A slot the greedy reader releases goes to its own next Gather (FIFO within a reader).
        rel = await peer.ReleaseStaging(
            peer_pb2.ReleaseStagingRequest(
                request_id="greedy-req", reader_id="greedy", slots=[granted[0].slot]
            ),
            metadata=greedy,
        )
        assert rel.released == 1
        first = await asyncio.wait_for(extra[0], 2.0)
        assert first.nbytes == ROW

        # The rest wait for its own slots until their deadline, and say why and what to do.
        results = await asyncio.gather(*extra[1:], return_exceptions=True)
        for err in results:
            assert isinstance(err, aio.AioRpcError), err
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            details = err.details() or ""
            assert "holds 2 staging slot(s)" in details, details
            assert "cap (2 of the ring's 4" in details, details
            assert "fix: release each slot as soon as it is read" in details, details

        await peer.ReleaseStaging(
            peer_pb2.ReleaseStagingRequest(
                request_id="greedy-req", reader_id="greedy", slots=[granted[1].slot, first.slot]
            ),
            metadata=greedy,
        )
        alive.cancel()
        await asyncio.gather(alive, return_exceptions=True)
        # Still serving: another STAGED pull completes with the whole ring free again.
        held2 = await engine.Hold(
            engine_pb2.HoldRequest(request_id="after-fair", block_ids=_ids([5, 6, 7]))
        )
        start2 = await dec.StartPull(
            scheduler_pb2.StartPullRequest(
                request_id=held2.request_id,
                peer_address=held2.peer_address,
                remote_block_ids=held2.remote_block_ids,
                local_block_ids=group_ids_to_proto([[50, 51, 52]]),
                deadline_ms=4000,
            )
        )
        stream = dec.WatchTransfers(
            scheduler_pb2.WatchTransfersRequest(transfer_ids=[start2.status.transfer_id])
        )
        async for msg in stream:
            if msg.status.state in TERMINAL:
                assert msg.status.state == scheduler_pb2.TRANSFER_STATE_DONE, (
                    msg.status.error.message
                )
                stream.cancel()
                break

    asyncio.run(go())
