"""Two real daemons: hold, pull, watch, cancel, and bytes verified through Checksum."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Sequence

import grpc
import pytest
from grpc import aio

from kvxferd.v1 import common_pb2, engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from kvxferd.wire.codec import group_ids_to_proto
from tests.service.conftest import Daemon

TERMINAL = {
    scheduler_pb2.TRANSFER_STATE_DONE,
    scheduler_pb2.TRANSFER_STATE_FAILED,
    scheduler_pb2.TRANSFER_STATE_CANCELLED,
    scheduler_pb2.TRANSFER_STATE_EXPIRED,
}


class Client:
    def __init__(self, prefill: Daemon, decode: Daemon) -> None:
        self.engine = engine_pb2_grpc.EngineStub(
            aio.insecure_channel(f"unix:{prefill.engine_socket}")
        )
        self.prefill = scheduler_pb2_grpc.SchedulerStub(aio.insecure_channel(prefill.grpc))
        self.decode = scheduler_pb2_grpc.SchedulerStub(aio.insecure_channel(decode.grpc))

    async def hold(self, rid: str, ids: Sequence[int]) -> engine_pb2.HoldResponse:
        return await self.engine.Hold(
            engine_pb2.HoldRequest(request_id=rid, block_ids=group_ids_to_proto([list(ids)]))
        )

    async def pull(
        self, held: engine_pb2.HoldResponse, local: Sequence[int], **kw: object
    ) -> scheduler_pb2.TransferStatus:
        resp = await self.decode.StartPull(
            scheduler_pb2.StartPullRequest(
                request_id=held.request_id,
                peer_address=held.peer_address,
                remote_block_ids=held.remote_block_ids,
                local_block_ids=group_ids_to_proto([list(local)]),
                **kw,  # type: ignore[arg-type]
            )
        )
        return resp.status

    async def wait(self, tid: str) -> scheduler_pb2.TransferStatus:
        stream = self.decode.WatchTransfers(scheduler_pb2.WatchTransfersRequest(transfer_ids=[tid]))
        async for msg in stream:
            if msg.status.state in TERMINAL:
                stream.cancel()
                return msg.status
        raise AssertionError("watch ended without a terminal state")

    async def digests(
        self, stub: scheduler_pb2_grpc.SchedulerStub, ids: Sequence[int]
    ) -> list[bytes]:
        resp = await stub.Checksum(
            scheduler_pb2.ChecksumRequest(group_index=0, block_ids=list(ids), kernel_block_ids=True)
        )
        return list(resp.digests)


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("remote", "local"),
    [
        ([0, 1, 2, 3], [10, 11, 12, 13]),  # contiguous both sides
        ([40, 3, 17, 9, 22], [5, 60, 2, 33, 1]),  # fragmented
        ([7, 8, 9, 10, 11, 12], [50, 51]),  # prefix hit: only the last two remote blocks
    ],
)
def test_pull_moves_exactly_the_requested_bytes(
    pair: tuple[Daemon, Daemon], remote: list[int], local: list[int]
) -> None:
    async def go() -> None:
        c = Client(*pair)
        before = await c.digests(c.decode, local)
        held = await c.hold(f"req-{remote[0]}-{len(local)}", remote)
        st = await c.pull(held, local)
        done = await c.wait(st.transfer_id)
        assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
        kept = remote[-len(local) :]
        assert done.nbytes == len(local) * 32 * 65536
        assert done.descriptors_after_coalescing <= done.descriptors_before_coalescing
        assert await c.digests(c.decode, local) == await c.digests(c.prefill, kept)
        assert await c.digests(c.decode, local) != before

    run(go())


def test_full_prefix_hit_completes_and_releases(pair: tuple[Daemon, Daemon]) -> None:
    async def go() -> None:
        c = Client(*pair)
        held = await c.hold("full-hit", [1, 2, 3])
        releases = c.engine.WatchReleases(engine_pb2.WatchReleasesRequest(request_ids=["full-hit"]))
        await releases.initial_metadata()  # registered before the pull can release anything
        st = await c.pull(held, [])
        done = await c.wait(st.transfer_id)
        assert done.state == scheduler_pb2.TRANSFER_STATE_DONE
        assert done.nbytes == 0
        rel = await asyncio.wait_for(releases.read(), 10)
        assert rel.request_id == "full-hit"
        assert list(rel.block_ids.groups[0].ids) == [1, 2, 3]
        releases.cancel()

    run(go())


def test_pull_of_a_request_not_held_fails_without_reading(pair: tuple[Daemon, Daemon]) -> None:
    async def go() -> None:
        c = Client(*pair)
        fake = engine_pb2.HoldResponse(
            peer_address=pair[0].grpc,
            request_id="never-held",
            remote_block_ids=group_ids_to_proto([[1]]),
        )
        before = await c.digests(c.decode, [63])
        st = await c.pull(fake, [63])
        done = await c.wait(st.transfer_id)
        assert done.state == scheduler_pb2.TRANSFER_STATE_FAILED
        # common.proto's ErrorDetail: the error's class, and message, field and fix each alone.
        err = done.error
        assert err.kind == common_pb2.ERROR_KIND_NOT_FOUND, err
        assert "not held" in err.message and err.fix and err.fix not in err.message
        assert err.field == "request_id" and not err.message.startswith("request_id:")
        assert await c.digests(c.decode, [63]) == before

    run(go())


def test_cancel_and_get(pair: tuple[Daemon, Daemon]) -> None:
    async def go() -> None:
        c = Client(*pair)
        held = await c.hold("to-cancel", list(range(20, 60)))
        st = await c.pull(held, list(range(20, 60)))
        resp = await c.decode.CancelTransfer(
            scheduler_pb2.CancelTransferRequest(transfer_id=st.transfer_id)
        )
        assert resp.status.state in TERMINAL
        got = await c.decode.GetTransfer(
            scheduler_pb2.GetTransferRequest(transfer_id=st.transfer_id)
        )
        assert got.status.state == resp.status.state
        if resp.status.state == scheduler_pb2.TRANSFER_STATE_CANCELLED:
            # Cancelled before posting: nothing written; after: every planned block invalid.
            groups = resp.status.invalid_local_block_ids.groups
            assert not groups or sorted(groups[0].ids) == list(range(20, 60))
        else:  # the copy finished before the cancel arrived
            assert resp.status.state == scheduler_pb2.TRANSFER_STATE_DONE

    run(go())


def test_peers_health_and_metrics(pair: tuple[Daemon, Daemon]) -> None:
    async def go() -> None:
        c = Client(*pair)
        peers = await c.decode.ListPeers(scheduler_pb2.ListPeersRequest())
        assert [p.address for p in peers.peers] == [pair[0].grpc]
        assert peers.peers[0].handshake_state == scheduler_pb2.HANDSHAKE_STATE_READY
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        h = health_pb2_grpc.HealthStub(aio.insecure_channel(pair[1].grpc))
        resp = await h.Check(health_pb2.HealthCheckRequest(service="kvxferd.v1.Scheduler"))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING

    run(go())
    body = urllib.request.urlopen(f"http://{pair[1].metrics}/metrics", timeout=5).read().decode()
    assert 'kvxferd_transfers_total{state="DONE",strategy="DIRECT"}' in body
    ok = urllib.request.urlopen(f"http://{pair[1].metrics}/healthz", timeout=5).read()
    assert ok == b"ok\n"


def test_unknown_transfer_is_not_found(pair: tuple[Daemon, Daemon]) -> None:
    async def go() -> None:
        c = Client(*pair)
        with pytest.raises(aio.AioRpcError) as ei:
            await c.decode.GetTransfer(scheduler_pb2.GetTransferRequest(transfer_id="nope"))
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND
        assert "transfer_id" in (ei.value.details() or "")

    run(go())


def _stage_counts(metrics: str) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith("kvxferd_pull_stage_seconds_count{"):
            stage = line.split('stage="', 1)[1].split('"', 1)[0]
            out[stage] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_pull_reports_where_its_time_went(pair: tuple[Daemon, Daemon]) -> None:
    """Issue 14, measure first: every DONE pull carries its stages in order (TransferStatus.stages
    names them), and each stage's histogram count grows by one; ``notify`` (terminal status to
    the WatchTransfers message) is only in the histogram, once per watcher that saw it end."""
    stages = ["decode", "handshake", "plan", "build", "confirm", "post", "transfer", "publish"]

    async def go() -> None:
        c = Client(*pair)
        before = _stage_counts(pair[1].metrics)
        watch = c.decode.WatchTransfers(scheduler_pb2.WatchTransfersRequest())
        await watch.initial_metadata()
        held = await c.hold("stages-1", [12, 13])
        t_asked = time.time_ns()
        st = await c.pull(held, [12, 13], transfer_id="stages-1-pull")
        async for msg in watch:
            if msg.status.transfer_id == st.transfer_id and msg.status.state in TERMINAL:
                break
        watch.cancel()
        done = await c.wait(st.transfer_id)
        assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
        assert [s.name for s in done.stages] == stages
        assert all(s.seconds >= 0 for s in done.stages)
        total = (done.finished_unix_ns - t_asked) / 1e9
        assert sum(s.seconds for s in done.stages) <= total + 0.05
        after = _stage_counts(pair[1].metrics)
        grown = {k: after.get(k, 0) - before.get(k, 0) for k in [*stages, "notify"]}
        # The second watch (c.wait) opened after the end: a snapshot, not a notification.
        assert grown == {**dict.fromkeys(stages, 1), "notify": 1}

    run(go())


def test_a_watcher_that_hangs_up_at_the_end_is_still_counted(pair: tuple[Daemon, Daemon]) -> None:
    """``notify`` is observed once per watcher that was sent a DONE status, also when the
    watcher cancels its stream the moment it reads that status (the usual client: wait for the
    end, then hang up) and the metrics are read right after."""
    pulls = 6

    async def go() -> None:
        c = Client(*pair)
        before = _stage_counts(pair[1].metrics).get("notify", 0)
        for i in range(pulls):
            watch = c.decode.WatchTransfers(scheduler_pb2.WatchTransfersRequest())
            await watch.initial_metadata()
            held = await c.hold(f"hang-up-{i}", [40 + i])
            st = await c.pull(held, [50 + i], transfer_id=f"hang-up-{i}-pull")
            async for msg in watch:
                if msg.status.transfer_id == st.transfer_id and msg.status.state in TERMINAL:
                    assert msg.status.state == scheduler_pb2.TRANSFER_STATE_DONE
                    break
            watch.cancel()
        assert _stage_counts(pair[1].metrics).get("notify", 0) - before == pulls

    run(go())


def _info_lines(daemon: Daemon, start: int) -> list[dict[str, object]]:
    """INFO (and louder) records the daemon logged after byte ``start`` of its log."""
    text = daemon.log.read_bytes()[start:].decode(errors="replace")
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("level") in ("info", "warning", "error", "critical"):
                out.append(rec)
    return out


def test_a_pull_logs_at_most_one_info_line_per_daemon(pair: tuple[Daemon, Daemon]) -> None:
    """In the normal case each daemon says at most one thing per request at INFO (the owner:
    the hold; a release that is not DONE stands out); the steps of a pull are DEBUG."""

    async def go() -> None:
        c = Client(*pair)
        warm = await c.hold("req-log-warm", [30, 31])  # first pull: peer lines, once per peer
        assert (await c.wait((await c.pull(warm, [30, 31])).transfer_id)).state == (
            scheduler_pb2.TRANSFER_STATE_DONE
        )
        time.sleep(0.5)
        marks = [d.log.stat().st_size for d in pair]
        held = await c.hold("req-log", [32, 33, 34])
        done = await c.wait((await c.pull(held, [40, 41, 42])).transfer_id)
        assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
        time.sleep(0.5)  # the owner's release follows the READ_DONE notification: not INFO
        seen = []
        for daemon, mark in zip(pair, marks, strict=True):
            lines = _info_lines(daemon, mark)
            assert len(lines) <= 1, f"{daemon.grpc} logged {len(lines)} INFO lines: {lines}"
            seen += lines
        assert any(line.get("request_id") == "req-log" for line in seen), seen  # not silent

    run(go())


def test_a_pull_streams_each_state_once_with_the_proto_timestamps(
    pair: tuple[Daemon, Daemon],
) -> None:
    """WatchTransfers (proto: "one message per change"): a pull is CONFIRMING from the moment
    it is accepted (its lease confirmation is already on its way), then TRANSFERRING, then DONE;
    started_unix_ns is when the bytes started moving (after created), finished after that."""

    async def go() -> None:
        c = Client(*pair)
        stream = c.decode.WatchTransfers(scheduler_pb2.WatchTransfersRequest())  # every pull
        held = await c.hold("states-1", [5, 6, 7])
        await c.pull(held, [8, 9, 10], transfer_id="states-1")
        seen = []
        async for msg in stream:
            if msg.status.transfer_id == "states-1":
                seen.append(msg.status)
                if msg.status.state in TERMINAL:
                    break
        stream.cancel()
        states = [s.state for s in seen]
        assert states[-1] == scheduler_pb2.TRANSFER_STATE_DONE, seen[-1].error.message
        assert scheduler_pb2.TRANSFER_STATE_PENDING not in states
        assert states[-2:] == [
            scheduler_pb2.TRANSFER_STATE_TRANSFERRING,
            scheduler_pb2.TRANSFER_STATE_DONE,
        ]
        assert len(states) == len(set(states)), states  # no change is sent twice
        done = seen[-1]
        assert 0 < done.created_unix_ns <= done.started_unix_ns <= done.finished_unix_ns

    run(go())
