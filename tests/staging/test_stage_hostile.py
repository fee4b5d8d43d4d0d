"""A hostile or confused reader on ``Peer.Stage`` against a real owner daemon: every bad open
is refused with what was wrong and a fix, a bad return fails only its stream, an owner waits
for credits, a broken stream's slots come back, and many streams never take more than the
reader's cap of slots (nor more streams than that cap: one more is refused). The owner keeps
serving throughout."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
from grpc import aio

from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import peer_pb2
from tests.service.conftest import Daemon, Daemons, launch
from tests.service.raw_peer import RawPeer, handshake
from tests.staging.stage_rig import Client, RawStage, granted_slots, staging, wait_log

TINY = "dense:num_blocks=256,num_layers=2,num_kv_heads=1,head_size=8"
ROW = 1024


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    """An owner with a 4-slot ring of 4 rows (cap 2 per reader) and a decode daemon whose
    ring of 8 lets it run 4 staged pulls at once."""
    d = launch(
        tmp_path_factory.mktemp("stage-hostile"),
        DaemonOptions("prefill", TINY, fill_seed=4, extra=staging("auto", 4 * ROW, 4)),
        DaemonOptions("decode", TINY, extra=staging("staged", ROW, 8)),
    )
    yield d
    d.stop()


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


async def refused(stage: RawStage) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(aio.AioRpcError) as ei:
        await stage.next()
    details = ei.value.details() or ""
    assert "fix:" in details, details
    return ei.value.code(), details


async def reader(owner: Daemon, agent: str) -> RawPeer:
    return await handshake(owner.grpc, TINY, agent=agent)


def test_bad_opens_are_refused_with_a_fix(ds: Daemons) -> None:
    async def go() -> None:
        owner = ds["prefill"]
        c = Client(owner, ds["decode"])
        await c.hold("bad-open", [[1, 2, 3, 4, 5, 6]])
        rp = await reader(owner, "bad-opener")

        async def try_open(
            ids: list[int], *, rid: str = "bad-open", who: RawPeer = rp, **kw: int
        ) -> tuple[grpc.StatusCode, str]:
            s = RawStage(who)
            args = {"chunk_bytes": ROW, "chunks": len(ids), "credits": 1} | kw
            s.open(rid, [ids], **args)
            return await refused(s)

        no_session = RawPeer(rp.stub)
        assert (await try_open([1], who=no_session))[0] == grpc.StatusCode.UNAUTHENTICATED
        assert (await try_open([1]))[0] == grpc.StatusCode.PERMISSION_DENIED  # not confirmed
        await rp.confirm("bad-open")
        code, text = await try_open([1], rid="never-held")
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "not held" in text, text
        code, text = await try_open([1, 9])
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "[9]" in text, text
        assert (await try_open([1, 256]))[0] == grpc.StatusCode.INVALID_ARGUMENT
        code, text = await try_open([1, 2, 3], credits=3)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 2" in text, text
        assert (await try_open([1], credits=0))[0] == grpc.StatusCode.INVALID_ARGUMENT
        code, text = await try_open([1], chunk_bytes=8 * ROW)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "slot size" in text, text
        code, text = await try_open([1, 2, 3], chunks=2)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "3 chunk(s)" in text, text
        s = RawStage(rp)
        s.give_back(0)  # no open first
        code, text = await refused(s)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "must set open" in text, text
        assert granted_slots(owner) == 0
        # A sound open on the same session is served: 3 one-row chunks, credit by credit.
        s = RawStage(rp)
        s.open("bad-open", [[4, 5, 6]], chunk_bytes=ROW, chunks=3, credits=1)
        for n in range(3):
            ev = await s.next()
            assert (ev.chunk, ev.nbytes, ev.offset) == (n, ROW, ev.slot * 4 * ROW)
            s.give_back(ev.slot)
        s.close()
        end = await wait_log(owner.log, "staged stream ended", request_id="bad-open")
        assert end["reason"] in ("done", "reader closed") and end["returned"] == 3, end

    run(go())


def test_owner_waits_for_credits_and_a_foreign_slot_fails_the_stream(ds: Daemons) -> None:
    async def go() -> None:
        owner = ds["prefill"]
        c = Client(owner, ds["decode"])
        await c.hold("credits", [[10, 11, 12]])
        rp = await reader(owner, "credit-reader")
        await rp.confirm("credits")
        s = RawStage(rp)
        s.open("credits", [[10, 11, 12]], chunk_bytes=ROW, chunks=3, credits=1)
        first = await s.next()
        pending = asyncio.ensure_future(s.next())
        await asyncio.sleep(0.3)
        assert not pending.done()  # one credit, not returned: nothing more is gathered
        assert granted_slots(owner) == 1
        s.give_back(first.slot)
        second = await pending
        assert second.chunk == 1
        s.give_back((second.slot + 1) % 4)  # not this stream's slot
        code, text = await refused(s)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not one of this stream" in text
        for _ in range(250):  # its announced slot went back with the stream
            if granted_slots(owner) == 0:
                break
            await asyncio.sleep(0.02)
        assert granted_slots(owner) == 0

    run(go())


def test_a_stream_ends_when_its_lease_ends(ds: Daemons) -> None:
    """A reader that lets its lease go but leaves its stream open (it holds an announced slot,
    so the owner waits for a credit): the owner ends the stream with the reason, its slots are
    back, and the reader's stream count with them."""

    async def go() -> None:
        owner = ds["prefill"]
        c = Client(owner, ds["decode"])
        await c.hold("lapsed", [[30, 31, 32]])
        rp = await reader(owner, "lapsing-reader")
        await rp.confirm("lapsed")
        s = RawStage(rp)
        s.open("lapsed", [[30, 31, 32]], chunk_bytes=ROW, chunks=3, credits=1)
        await s.next()
        assert granted_slots(owner) == 1
        await rp.release("lapsed", done=False)  # the only reader gave up: the lease ends
        code, text = await refused(s)
        assert code == grpc.StatusCode.FAILED_PRECONDITION, text
        assert "lease of 'lapsed' ended while its Stage stream was open" in text, text
        end = await wait_log(owner.log, "staged stream ended", request_id="lapsed")
        assert end["reason"] == "lease ended" and end["started"] == 1, end
        assert granted_slots(owner) == 0

    run(go())


def test_a_broken_stream_frees_its_slots(ds: Daemons) -> None:
    async def go() -> None:
        owner = ds["prefill"]
        c = Client(owner, ds["decode"])
        await c.hold("broken", [list(range(20, 28))])
        rp = await reader(owner, "breaker")
        await rp.confirm("broken")
        s = RawStage(rp)
        s.open("broken", [list(range(20, 28))], chunk_bytes=ROW, chunks=8, credits=2)
        await s.next()
        await s.next()
        assert granted_slots(owner) == 2
        s.call.cancel()  # the reader goes away without returning anything
        end = await wait_log(owner.log, "staged stream ended", request_id="broken")
        assert end["reason"] in ("cancelled", "reader closed") and end["started"] == 2, end
        assert granted_slots(owner) == 0

    run(go())


def test_streams_of_one_reader_hold_at_most_its_cap_and_one_more_is_refused(
    ds: Daemons,
) -> None:
    async def go() -> None:
        owner, decode = ds["prefill"], ds["decode"]
        c = Client(owner, decode)
        greedy = await reader(owner, "greedy")

        async def stream(i: int) -> RawStage:
            rid = f"greedy-{i}"
            ids = [100 + 4 * i + k for k in range(4)]
            await c.hold(rid, [ids])
            await greedy.confirm(rid)
            s = RawStage(greedy)
            s.open(rid, [ids], chunk_bytes=ROW, chunks=4, credits=2)
            return s

        streams = [await stream(0), await stream(1)]  # its cap (2) of streams
        got: list[peer_pb2.StageResponse] = []

        async def collect(s: RawStage) -> None:
            while True:
                got.append(await s.next(timeout_s=30))

        reads = [asyncio.ensure_future(collect(s)) for s in streams]
        await asyncio.sleep(0.5)
        assert len(got) == 2  # its cap of slots over all its streams, never returned
        assert granted_slots(owner) == 2
        # A third stream of the same reader: refused, with its limit and the fix.
        code, text = await refused(await stream(2))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, text
        assert "2 Stage streams open on this owner already" in text, text
        assert "keep at most 2 Stage streams open" in text, text
        # Another reader's STAGED pull still gets the other half of the ring.
        st = await c.pull(await c.hold("beside-greedy", [[200, 201, 202]]), [[3, 4, 5]])
        assert st.state == 5, st.error.message  # TRANSFER_STATE_DONE
        assert await c.same([[200, 201, 202]], [[3, 4, 5]])
        # A stream that ended makes room for the next one.
        streams[0].call.cancel()
        await wait_log(owner.log, "staged stream ended", request_id="greedy-0")
        again = await stream(3)
        first = await again.next(timeout_s=30)  # once a slot of the greedy's cap is free
        assert first.chunk == 0
        for s in (streams[1], again):
            s.call.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
        for _ in range(250):
            if granted_slots(owner) == 0:
                break
            await asyncio.sleep(0.02)
        assert granted_slots(owner) == 0

    run(go())


def test_a_reader_daemon_keeps_to_the_owner_stream_cap_and_every_pull_completes(
    ds: Daemons,
) -> None:
    """The decode daemon may run 4 staged pulls at once (its ring of 8), the owner takes 2
    streams per reader: the others wait for a stream on the reader's side, none is refused."""

    async def go() -> None:
        c = Client(ds["prefill"], ds["decode"])
        remote = [[40 + 6 * i + k for k in range(6)] for i in range(6)]
        local = [[60 + 6 * i + k for k in range(6)] for i in range(6)]
        holds = [await c.hold(f"many-{i}", [r]) for i, r in enumerate(remote)]
        done = await asyncio.gather(*(c.pull(h, [lo]) for h, lo in zip(holds, local, strict=True)))
        for st in done:
            assert st.state == 5, st.error.message  # TRANSFER_STATE_DONE
            assert st.stage_times.stream and st.stage_times.chunks == 6
        for r, lo in zip(remote, local, strict=True):
            assert await c.same([r], [lo])

    run(go())


def test_stage_events_carry_the_documented_fields() -> None:
    fields = {f.name for f in peer_pb2.StageResponse.DESCRIPTOR.fields}
    assert fields == {"chunk", "slot", "offset", "nbytes", "gather_us", "start_us", "slot_wait_us"}
