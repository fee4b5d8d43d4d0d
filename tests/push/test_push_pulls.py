"""Push mode through real daemons: StartPull on the decode daemon, the prefill daemon WRITEs,
bytes verified through Checksum exactly as for pulls; a pull-mode decode daemon is refused."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from grpc import aio

from kvxferd.v1 import engine_pb2, scheduler_pb2
from tests.push.client import Client
from tests.service.conftest import Daemons

ROW = 32 * 65536  # bytes of one dense:num_blocks=64 logical block


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("remote", "local"),
    [
        ([0, 1, 2, 3], [10, 11, 12, 13]),  # contiguous both sides
        ([40, 3, 17, 9, 22], [5, 60, 2, 33, 1]),  # fragmented
        ([7, 8, 9, 10, 11, 12], [50, 51]),  # prefix hit: only the last two remote blocks
    ],
)
def test_push_writes_exactly_the_requested_bytes(
    push: Daemons, remote: list[int], local: list[int]
) -> None:
    async def go() -> None:
        c = Client(push["prefill"], push["decode"])
        before = await c.local_digests([local])
        done = await c.pull(await c.hold(f"push-{remote[0]}-{len(local)}", [remote]), [local])
        assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
        assert "push mode" in done.strategy_reason
        assert done.nbytes == len(local) * ROW
        assert done.descriptors_after_coalescing >= 1
        assert [s.name for s in done.stages][-3:] == ["post", "transfer", "publish"]
        assert not done.invalid_local_block_ids.groups
        assert await c.same([remote[-len(local) :]], [local])
        assert await c.local_digests([local]) != before

    run(go())


def test_concurrent_hybrid_pushes_are_byte_exact(push: Daemons) -> None:
    """Three pushes at once, the first this pair ever runs: the prefill daemon loads the
    decode daemon's NIXL metadata once, and no push cancels another's WRITE."""

    async def go() -> None:
        c = Client(push["h-prefill"], push["h-decode"])
        pairs = [
            ([[3, 11, 7], [5]], [[14, 0, 9], [2]]),
            ([[1, 2], [0]], [[4, 5], [1]]),
            ([[8, 6, 12, 13], [3]], [[7, 3, 10, 15], [6]]),
        ]
        helds = [await c.hold(f"push-hybrid-{i}", r) for i, (r, _) in enumerate(pairs)]
        starts = await asyncio.gather(
            *(c.start(h, lo) for h, (_, lo) in zip(helds, pairs, strict=True))
        )
        for st, (remote, local) in zip(starts, pairs, strict=True):
            done = await c.wait(st.transfer_id)
            assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
            assert await c.same(remote, local)

    run(go())


def test_push_with_prefix_caching_trims_as_a_pull_does(push: Daemons) -> None:
    """A cached prefix on the decode side: only the uncached tail of the attention blocks is
    written (the Mamba state always), paired from the end as a pull pairs them."""

    async def go() -> None:
        c = Client(push["hp-prefill"], push["hp-decode"])
        remote, local = [[3, 11, 7, 4], [5]], [[9, 2], [1]]
        before = await c.local_digests(local)
        done = await c.pull(await c.hold("push-prefix", remote), local)
        assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
        assert await c.same([[7, 4], [5]], local)
        assert await c.local_digests(local) != before

    run(go())


def test_a_full_prefix_hit_writes_nothing_and_releases(push: Daemons) -> None:
    async def go() -> None:
        c = Client(push["prefill"], push["decode"])
        releases = c.engine.WatchReleases(engine_pb2.WatchReleasesRequest(request_ids=["push-hit"]))
        done = await c.pull(await c.hold("push-hit", [[1, 2, 3]]), [[]])
        assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
        assert done.nbytes == 0
        rel = await asyncio.wait_for(releases.read(), 10)
        assert list(rel.block_ids.groups[0].ids) == [1, 2, 3]
        releases.cancel()

    run(go())


def test_a_push_releases_the_hold(push: Daemons) -> None:
    """The prefill daemon ends the decode's share when its WRITE completed: the engine hears
    the release (DONE), as after a pull."""

    async def go() -> None:
        c = Client(push["prefill"], push["decode"])
        releases = c.engine.WatchReleases(engine_pb2.WatchReleasesRequest(request_ids=["push-rel"]))
        held = await c.hold("push-rel", [[20, 21]])
        done = await c.pull(held, [[30, 31]])
        assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
        rel = await asyncio.wait_for(releases.read(), 10)
        assert rel.request_id == "push-rel"
        assert list(rel.block_ids.groups[0].ids) == [20, 21]
        releases.cancel()

    run(go())


def test_a_push_of_a_request_not_held_fails_without_writing(push: Daemons) -> None:
    async def go() -> None:
        c = Client(push["prefill"], push["decode"])
        decoy = await c.hold("push-decoy", [[1]])
        fake = engine_pb2.HoldResponse(
            peer_address=push["prefill"].grpc,
            request_id="push-never-held",
            remote_block_ids=decoy.remote_block_ids,
        )
        before = await c.local_digests([[63]])
        done = await c.pull(fake, [[63]])
        assert done.state == scheduler_pb2.TRANSFER_STATE_FAILED
        assert "not held" in done.error.message
        assert not done.invalid_local_block_ids.groups  # nothing was asked to write
        assert await c.local_digests([[63]]) == before

    run(go())


def test_mismatched_modes_are_refused_at_handshake(push: Daemons) -> None:
    async def go() -> None:
        c = Client(push["prefill"], push["pull-decode"])
        held = await c.hold("push-mismatch", [[4]])
        with pytest.raises(aio.AioRpcError) as ei:
            await c.start(held, [[4]])
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        text = ei.value.details() or ""
        # Refused by the prefill daemon (it checks first), in its words: local = push.
        assert "refused by the peer" in text, text
        assert "transfer mode (transfer.mode) is local 'push', remote 'pull'" in text, text
        assert "set transfer.mode = 'pull' on the daemon that runs 'push'" in text

    run(go())


def test_push_metrics_count_the_write_done_notification(push: Daemons) -> None:
    body = urllib.request.urlopen(f"http://{push['decode'].metrics}/metrics", timeout=5).read()
    assert b'kvxferd_notifications_total{result="counted"}' in body
    assert b'kvxferd_transfers_total{state="DONE",strategy="DIRECT"}' in body
