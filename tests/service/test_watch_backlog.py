"""A watch whose caller stops reading cannot make a daemon hold its messages without end
(kvxferd/daemon/backlog.py; scheduler.proto WatchTransfers, engine.proto WatchReleases): past
``server.watch_backlog`` unsent messages the stream ends RESOURCE_EXHAUSTED, saying why and
what to do, and the daemon serves on. The decode daemon's memory of requests whose share it
ended is bounded by count as well as by age (kvxferd/daemon/claims.py).

Before: both watches queued every change for an unread stream (the decode daemon grew by ~2 MB
per 1,000 pulls with one unread watch-all stream open, and kept it after the stream was
cancelled), and the ended claims were dropped only after 600 s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
from grpc import aio

from kvxferd.daemon.backlog import Backlog
from kvxferd.daemon.claims import ReadClaims
from kvxferd.daemon.pulls import PullBook, PullRecord, PullState
from kvxferd.errors import LeaseRefused, ResourceExhausted
from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.service.conftest import Daemons, launch
from tests.service.test_service_pull import Client

SPEC = "dense:num_blocks=32,num_layers=2"
BACKLOG = 4
PULLS = 60
# A client that lets only a few messages into its window, so that an unread stream backs up
# into the daemon after a handful of changes (no BDP probing to grow the window).
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


def test_a_backlog_keeps_order_and_ends_past_its_limit() -> None:
    async def go() -> None:
        q: Backlog[int] = Backlog(3, "test stream", "read faster")
        for i in range(3):
            q.put(i)
        assert [await q.get() for _ in range(3)] == [0, 1, 2]
        waiting = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        q.put(10)  # a waiting getter takes what comes when it runs
        assert await waiting == 10
        for i in range(4):  # the fourth unsent message is one too many
            q.put(20 + i)
        with pytest.raises(ResourceExhausted) as err:
            await q.get()
        assert len(q) == 0 and q.overflowed  # dropped at once, not when it reads
        assert "test stream fell more than 3 messages behind" in err.value.message
        assert err.value.fix == "read faster"
        q.put(99)  # an ended watch takes nothing more
        assert len(q) == 0

        blocked: Backlog[int] = Backlog(1, "s", "f")
        getter = asyncio.ensure_future(blocked.get())
        await asyncio.sleep(0)
        blocked.put(1)
        blocked.put(2)  # past the limit before the waiting getter ran: it wakes to the error
        with pytest.raises(ResourceExhausted):
            await getter

        unbounded: Backlog[int] = Backlog(None, "session", "")
        for i in range(10_000):
            unbounded.put(i)
        assert len(unbounded) == 10_000 and not unbounded.overflowed

    asyncio.run(go())


def _rec(tid: str) -> PullRecord:
    return PullRecord(transfer_id=tid, request_id="r", peer_address="127.0.0.1:1", nbytes=8)


def test_a_book_watch_gets_its_snapshot_then_at_most_the_backlog() -> None:
    async def go() -> None:
        book = PullBook(watch_backlog=2)
        for i in range(5):
            book.add(_rec(f"t{i}"))
        stream = book.follow(frozenset())
        # The snapshot (five pulls) comes on top of the backlog...
        book.update("t0", state=PullState.TRANSFERRING)
        book.update("t1", state=PullState.TRANSFERRING)
        got = [(await stream.__anext__()).transfer_id for _ in range(7)]
        assert got == ["t0", "t1", "t2", "t3", "t4", "t0", "t1"]
        # Its room is the snapshot's and the backlog's: eight unread changes are one too many.
        for i in range(8):
            book.update(f"t{i % 5}", posted_descriptors=i)
        with pytest.raises(ResourceExhausted, match="WatchTransfers stream fell more than"):
            await stream.__anext__()
        stream.close()
        assert not book._watchers

    asyncio.run(go())


def test_ended_claims_are_bounded_by_count_oldest_first() -> None:
    claims = ReadClaims(max_ended=3)
    for i in range(5):
        assert claims.claim("owner:1", f"r{i}", f"t{i}")
        claims.release("owner:1", f"r{i}", f"t{i}", ended=True)
    assert claims.ended == 3
    assert claims.claim("owner:1", "r0", "t0-again")  # the oldest two were let go
    assert claims.claim("owner:1", "r1", "t1-again")
    for i in (2, 3, 4):  # the newest three are still refused
        with pytest.raises(LeaseRefused):
            claims.claim("owner:1", f"r{i}", f"t{i}-again")


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    small = ("--set", f"server.watch_backlog={BACKLOG}")
    ds = launch(
        tmp_path_factory.mktemp("watch-backlog"),
        DaemonOptions("prefill", SPEC, fill_seed=3, extra=small),
        DaemonOptions("decode", SPEC, extra=small),
    )
    yield ds
    ds.stop()


async def _pulls(c: Client, n: int, tag: str) -> None:
    for i in range(n):
        st = await c.pull(await c.hold(f"{tag}-{i}", [i % 8]), [8 + i % 8], wait=True)
        assert st.state == scheduler_pb2.TRANSFER_STATE_DONE, st.error.message


def test_an_unread_watch_stream_is_ended_and_the_daemons_serve_on(daemons: Daemons) -> None:
    async def go() -> None:
        c = Client(daemons["prefill"], daemons["decode"])
        slow_decode = aio.insecure_channel(daemons["decode"].grpc, options=SMALL_WINDOW)
        slow_engine = aio.insecure_channel(
            f"unix:{daemons['prefill'].engine_socket}", options=SMALL_WINDOW
        )
        try:
            watch = scheduler_pb2_grpc.SchedulerStub(slow_decode).WatchTransfers(
                scheduler_pb2.WatchTransfersRequest()
            )
            releases = engine_pb2_grpc.EngineStub(slow_engine).WatchReleases(
                engine_pb2.WatchReleasesRequest()
            )
            await watch.initial_metadata()
            await releases.initial_metadata()
            await _pulls(c, PULLS, "unread")  # ~4 status changes and one release each, unread
            for stream, name in ((watch, "WatchTransfers"), (releases, "WatchReleases")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stream:
                        pass
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
                text = err.value.details() or ""
                assert f"{name} stream fell more than" in text, text
                assert "fix:" in text and "open it again" in text, text
            # The daemons serve on, and a new watch starts with every pull's status.
            await _pulls(c, 3, "after")
            fresh = c.decode.WatchTransfers(scheduler_pb2.WatchTransfersRequest())
            done = 0
            async for msg in fresh:
                done += msg.status.state == scheduler_pb2.TRANSFER_STATE_DONE
                if done == PULLS + 3:
                    break
            fresh.cancel()
        finally:
            await slow_decode.close()
            await slow_engine.close()

    asyncio.run(go())
