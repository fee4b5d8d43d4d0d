"""STAGED pulls between real daemons: bytes verified through Checksum, strategy visible in the
status and metrics, back-pressure on a 2-slot ring, Gather refusals that leave the daemon up."""

from __future__ import annotations

import asyncio
import random
import urllib.request
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
from tests.service.conftest import Daemon, Daemons, launch
from tests.service.raw_peer import RawPeer, handshake

TERMINAL = {
    scheduler_pb2.TRANSFER_STATE_DONE,
    scheduler_pb2.TRANSFER_STATE_FAILED,
    scheduler_pb2.TRANSFER_STATE_CANCELLED,
    scheduler_pb2.TRANSFER_STATE_EXPIRED,
}
ROW = 32 * 65536  # one dense block row: 32 layers x 64 KiB


def _staging(strategy: str, chunk_bytes: int, chunks: int) -> tuple[str, ...]:
    return (
        "--set",
        f"transfer.strategy={strategy}",
        "--set",
        f"transfer.staging_chunk_bytes={chunk_bytes}",
        "--set",
        f"transfer.staging_chunks={chunks}",
    )


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    """A prefill daemon, a decode daemon forced STAGED on a 2-slot ring of 2 rows each, and a
    decode daemon forced DIRECT."""
    ds = launch(
        tmp_path_factory.mktemp("staged"),
        DaemonOptions(
            "prefill", "dense:num_blocks=64", fill_seed=5, extra=_staging("auto", 4 * ROW, 2)
        ),
        DaemonOptions("staged", "dense:num_blocks=64", extra=_staging("staged", 2 * ROW, 2)),
        DaemonOptions("direct", "dense:num_blocks=64", extra=_staging("direct", 2 * ROW, 2)),
    )
    yield ds
    ds.stop()


class Client:
    def __init__(self, prefill: Daemon, decode: Daemon) -> None:
        self.engine = engine_pb2_grpc.EngineStub(
            aio.insecure_channel(f"unix:{prefill.engine_socket}")
        )
        self.prefill = scheduler_pb2_grpc.SchedulerStub(aio.insecure_channel(prefill.grpc))
        self.peer = peer_pb2_grpc.PeerStub(aio.insecure_channel(prefill.grpc))
        self.decode = scheduler_pb2_grpc.SchedulerStub(aio.insecure_channel(decode.grpc))

    async def hold(self, rid: str, groups: Sequence[Sequence[int]]) -> engine_pb2.HoldResponse:
        return await self.engine.Hold(
            engine_pb2.HoldRequest(request_id=rid, block_ids=group_ids_to_proto(list(groups)))
        )

    async def pull(
        self, held: engine_pb2.HoldResponse, local: Sequence[Sequence[int]]
    ) -> scheduler_pb2.TransferStatus:
        resp = await self.decode.StartPull(
            scheduler_pb2.StartPullRequest(
                request_id=held.request_id,
                peer_address=held.peer_address,
                remote_block_ids=held.remote_block_ids,
                local_block_ids=group_ids_to_proto(list(local)),
            )
        )
        return await self.wait(resp.status.transfer_id)

    async def wait(self, tid: str) -> scheduler_pb2.TransferStatus:
        stream = self.decode.WatchTransfers(scheduler_pb2.WatchTransfersRequest(transfer_ids=[tid]))
        async for msg in stream:
            if msg.status.state in TERMINAL:
                stream.cancel()
                return msg.status
        raise AssertionError("watch ended without a terminal state")

    async def digests(
        self, stub: scheduler_pb2_grpc.SchedulerStub, group: int, ids: Sequence[int]
    ) -> list[bytes]:
        resp = await stub.Checksum(
            scheduler_pb2.ChecksumRequest(group_index=group, block_ids=list(ids))
        )
        return list(resp.digests)

    async def same(self, remote: Sequence[Sequence[int]], local: Sequence[Sequence[int]]) -> bool:
        for g, (r, lo) in enumerate(zip(remote, local, strict=True)):
            if await self.digests(self.decode, g, lo) != await self.digests(self.prefill, g, r):
                return False
        return True


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def _random_ids(rng: random.Random, n: int, count: int) -> list[int]:
    return rng.sample(range(count), n)


def test_staged_pull_of_random_blocks_is_byte_exact(dense: Daemons) -> None:
    async def go() -> None:
        c = Client(dense["prefill"], dense["staged"])
        rng = random.Random(1)
        remote, local = _random_ids(rng, 9, 64), _random_ids(rng, 9, 64)
        held = await c.hold("staged-1", [remote])
        st = await c.pull(held, [local])
        assert st.state == scheduler_pb2.TRANSFER_STATE_DONE, st.error.message
        assert st.strategy == scheduler_pb2.TRANSFER_STRATEGY_STAGED
        assert "forced" in st.strategy_reason
        assert st.nbytes == 9 * ROW
        assert st.stage_times.chunks == 5  # 2 rows per slot
        assert st.stage_times.read_seconds > 0
        assert await c.same([remote], [local])

    run(go())
    body = urllib.request.urlopen(f"http://{dense['staged'].metrics}/metrics", timeout=5).read()
    text = body.decode()
    assert 'kvxferd_transfers_total{state="DONE",strategy="STAGED"}' in text
    assert 'kvxferd_strategy_bytes_total{strategy="STAGED"}' in text
    assert 'kvxferd_staged_stage_seconds_count{stage="scatter"}' in text


def test_forced_direct_is_visible_and_exact(dense: Daemons) -> None:
    async def go() -> None:
        c = Client(dense["prefill"], dense["direct"])
        remote, local = [40, 3, 17, 9], [5, 60, 2, 33]
        st = await c.pull(await c.hold("direct-1", [remote]), [local])
        assert st.state == scheduler_pb2.TRANSFER_STATE_DONE, st.error.message
        assert st.strategy == scheduler_pb2.TRANSFER_STRATEGY_DIRECT
        assert "direct" in st.strategy_reason
        assert st.stage_times.chunks == 0
        assert await c.same([remote], [local])

    run(go())


def test_concurrent_staged_pulls_share_a_two_slot_ring(dense: Daemons) -> None:
    async def go() -> None:
        c = Client(dense["prefill"], dense["staged"])
        rng = random.Random(7)
        local_all = _random_ids(rng, 40, 64)
        jobs = []
        for i in range(4):
            remote = _random_ids(rng, 10, 64)
            local = local_all[i * 10 : (i + 1) * 10]
            jobs.append((remote, local, await c.hold(f"conc-{i}", [remote])))
        done = await asyncio.gather(*(c.pull(h, [lo]) for _, lo, h in jobs))
        for st in done:
            assert st.state == scheduler_pb2.TRANSFER_STATE_DONE, st.error.message
            assert st.strategy == scheduler_pb2.TRANSFER_STRATEGY_STAGED
        for remote, local, _ in jobs:
            assert await c.same([remote], [local])

    run(go())


def test_gather_refuses_ids_outside_the_lease_and_the_pool(dense: Daemons) -> None:
    async def go() -> None:
        c = Client(dense["prefill"], dense["staged"])
        await c.hold("gather-guard", [[1, 2, 3]])
        rp = await handshake(dense["prefill"].grpc, "dense:num_blocks=64", agent="guard")
        other = await handshake(dense["prefill"].grpc, "dense:num_blocks=64", agent="other")

        async def gather(rid: str, ids: list[int], who: RawPeer = rp) -> grpc.StatusCode:
            with pytest.raises(aio.AioRpcError) as ei:
                await c.peer.Gather(
                    peer_pb2.GatherRequest(
                        request_id=rid,
                        reader_id="intruder",
                        kernel_block_ids=common_pb2.GroupBlockIds(
                            groups=[common_pb2.BlockIds(ids=ids)]
                        ),
                    ),
                    timeout=5,
                    metadata=who.md,
                )
            details = ei.value.details() or ""
            assert "fix:" in details, details
            return ei.value.code()

        # Without a session, or before confirming the lease, nothing is gathered.
        assert (
            await gather("gather-guard", [1], RawPeer(rp.stub)) == grpc.StatusCode.UNAUTHENTICATED
        )
        assert await gather("gather-guard", [1]) == grpc.StatusCode.PERMISSION_DENIED
        await rp.confirm("gather-guard")
        assert await gather("gather-guard", [1], other) == grpc.StatusCode.PERMISSION_DENIED
        assert await gather("gather-guard", [1, 9]) == grpc.StatusCode.FAILED_PRECONDITION
        assert await gather("gather-guard", [1, 64]) == grpc.StatusCode.INVALID_ARGUMENT
        assert await gather("gather-guard", [-1]) == grpc.StatusCode.INVALID_ARGUMENT
        assert await gather("not-held", [1]) == grpc.StatusCode.FAILED_PRECONDITION
        # A leased ID is gathered; the slot goes back with ReleaseStaging.
        resp = await c.peer.Gather(
            peer_pb2.GatherRequest(
                request_id="gather-guard",
                reader_id="r",
                kernel_block_ids=common_pb2.GroupBlockIds(groups=[common_pb2.BlockIds(ids=[2])]),
            ),
            timeout=5,
            metadata=rp.md,
        )
        assert resp.nbytes == ROW
        # Another session cannot give the slot back; its own reader can.
        stolen = await c.peer.ReleaseStaging(
            peer_pb2.ReleaseStagingRequest(
                request_id="gather-guard", reader_id="guard", slots=[resp.slot]
            ),
            metadata=other.md,
        )
        assert stolen.released == 0
        rel = await c.peer.ReleaseStaging(
            peer_pb2.ReleaseStagingRequest(
                request_id="gather-guard", reader_id="r", slots=[resp.slot]
            ),
            metadata=rp.md,
        )
        assert rel.released == 1
        # Still serving: a pull afterwards completes.
        st = await c.pull(await c.hold("after-guard", [[10, 11]]), [[20, 21]])
        assert st.state == scheduler_pb2.TRANSFER_STATE_DONE, st.error.message

    run(go())


def test_owner_reclaims_slots_when_the_lease_ends(dense: Daemons) -> None:
    async def go() -> None:
        c = Client(dense["prefill"], dense["staged"])
        rp = await handshake(dense["prefill"].grpc, "dense:num_blocks=64", agent="dies")
        for i in range(3):  # more gathers than the owner's 2 slots: each lease end frees one
            rid = f"abandoned-{i}"
            await c.hold(rid, [[30 + i]])
            await rp.confirm(rid)
            await c.peer.Gather(
                peer_pb2.GatherRequest(
                    request_id=rid,
                    reader_id="dies",
                    kernel_block_ids=common_pb2.GroupBlockIds(
                        groups=[common_pb2.BlockIds(ids=[30 + i])]
                    ),
                ),
                timeout=5,
                metadata=rp.md,
            )
            await rp.release(rid)

    run(go())


def test_cancel_mid_staged_pull_reports_invalid_blocks_and_frees_slots(dense: Daemons) -> None:
    async def go() -> None:
        c = Client(dense["prefill"], dense["staged"])
        remote, local = list(range(0, 60)), list(range(63, 3, -1))
        held = await c.hold("staged-cancel", [remote])
        resp = await c.decode.StartPull(
            scheduler_pb2.StartPullRequest(
                request_id=held.request_id,
                peer_address=held.peer_address,
                remote_block_ids=held.remote_block_ids,
                local_block_ids=group_ids_to_proto([local]),
            )
        )
        await asyncio.sleep(0.2)
        got = await c.decode.CancelTransfer(
            scheduler_pb2.CancelTransferRequest(transfer_id=resp.status.transfer_id)
        )
        st = got.status
        assert st.state in TERMINAL
        if st.state == scheduler_pb2.TRANSFER_STATE_CANCELLED:
            assert sorted(st.invalid_local_block_ids.groups[0].ids) == sorted(local)
        # Every slot came back: further staged pulls still complete.
        remote2, local2 = [50, 7, 33, 12], [1, 2, 3, 4]
        st2 = await c.pull(await c.hold("after-cancel", [remote2]), [local2])
        assert st2.state == scheduler_pb2.TRANSFER_STATE_DONE, st2.error.message
        assert await c.same([remote2], [local2])

    run(go())


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    """Hybrid (attention + Mamba) and cross-layer pairs, decode sides forced STAGED."""
    ds = launch(
        tmp_path_factory.mktemp("staged-mixed"),
        DaemonOptions("h-prefill", "hybrid", fill_seed=9, extra=_staging("auto", 1 << 20, 2)),
        DaemonOptions("h-decode", "hybrid", extra=_staging("staged", 1 << 20, 4)),
        DaemonOptions(
            "x-prefill",
            "dense:num_blocks=32,cross_layer=1",
            fill_seed=4,
            extra=_staging("auto", 4 * ROW, 2),
        ),
        DaemonOptions(
            "x-decode", "dense:num_blocks=32,cross_layer=1", extra=_staging("staged", 3 * ROW, 4)
        ),
    )
    yield ds
    ds.stop()


def test_staged_hybrid_pull_is_byte_exact(mixed: Daemons) -> None:
    async def go() -> None:
        c = Client(mixed["h-prefill"], mixed["h-decode"])
        remote = [[3, 11, 7], [5]]
        local = [[14, 0, 9], [2]]
        st = await c.pull(await c.hold("hybrid-1", remote), local)
        assert st.state == scheduler_pb2.TRANSFER_STATE_DONE, st.error.message
        assert st.strategy == scheduler_pb2.TRANSFER_STRATEGY_STAGED, st.strategy_reason
        assert st.stage_times.chunks > 1
        assert await c.same(remote, local)

    run(go())


def test_staged_cross_layer_pull_is_byte_exact(mixed: Daemons) -> None:
    async def go() -> None:
        c = Client(mixed["x-prefill"], mixed["x-decode"])
        remote, local = [[30, 2, 17, 8, 21, 5, 11]], [[1, 29, 4, 13, 0, 22, 7]]
        st = await c.pull(await c.hold("cross-1", remote), local)
        assert st.state == scheduler_pb2.TRANSFER_STATE_DONE, st.error.message
        assert st.strategy == scheduler_pb2.TRANSFER_STRATEGY_STAGED, st.strategy_reason
        assert st.stage_times.chunks == 3
        assert await c.same(remote, local)

    run(go())
