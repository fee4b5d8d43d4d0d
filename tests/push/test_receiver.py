"""The decode side of a push (kvxferd.daemon.receiver) against an in-process owner
(FakeTransport): every way a push ends, and which local blocks it lists.

The WRITE_DONE notification is delivered as the notification pump delivers it (``landed`` from
another thread); the owner's answer and timing are scripted. What the real owner does is tested
through real daemons in test_push_pulls.py and test_push_hostile.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.blocks.ranges import RegionRanges, TransferPlan
from kvxferd.daemon.peers import LinkState, PeerLink, RemoteDescription
from kvxferd.daemon.receiver import PushReceiver, write_timeout_s
from kvxferd.errors import DeadlineExceeded, LeaseRefused, PeerUnavailable
from kvxferd.layout import preset
from kvxferd.peers import PeerInfo
from kvxferd.transfer import TransferStatus, notify
from kvxferd.v1 import peer_pb2
from kvxferd.wire.peer_client import FakeTransport, Metadata, PeerClient

AGENT = "prefill-agent"
BLOCKS = (np.array([5, 9, 2], dtype=np.int64),)
PLAN = TransferPlan(
    ranges=(
        RegionRanges(
            0,
            "kv",
            np.array([0, 4096], dtype=np.int64),
            np.array([8192, 0], dtype=np.int64),
            np.array([4096, 4096], dtype=np.int64),
        ),
    ),
    local_kernel_blocks=BLOCKS,
)
Owner = Callable[[peer_pb2.PushRequest, PushReceiver], Awaitable[Any]]


def _link(owner: Owner, rx: PushReceiver, seen: list[peer_pb2.PushRequest]) -> PeerLink:
    async def handler(method: str, request: Any, metadata: Metadata) -> Any:
        assert method == "Push"
        seen.append(request)
        return await owner(request, rx)

    spec = preset("dense:num_blocks=8")
    remote = RemoteDescription(
        info=PeerInfo(spec=spec, tp_rank=0, tp_size=1, prefix_caching=False),
        agent_name=AGENT,
        agent_metadata=b"",
        regions=np.zeros((0, 3), dtype=np.int64),
        generation=1,
        daemon_id="prefill",
        instance_id="i1",
        address="prefill:1",
    )
    client = PeerClient("prefill:1", FakeTransport(handler))
    return PeerLink("prefill:1", client, LinkState.READY, remote)


def _land(rx: PushReceiver, req: peer_pb2.PushRequest, sender: str = AGENT) -> bool:
    """Deliver the WRITE_DONE notification from the NIXL thread, as the pump does."""
    out: list[bool] = []
    note = notify.decode(
        notify.encode(req.request_id, req.notif_ticket, notify.NotifKind.WRITE_DONE)
    )
    t = threading.Thread(target=lambda: out.append(rx.landed(sender, note)))
    t.start()
    t.join()
    return out[0]


def _receive(owner: Owner, deadline_s: float = 2.0, *, cancel_after: float | None = None) -> Any:
    async def go() -> Any:
        rx = PushReceiver()
        seen: list[peer_pb2.PushRequest] = []
        link = _link(owner, rx, seen)
        loop = asyncio.get_running_loop()
        job = loop.create_task(
            rx.receive(
                "t1",
                "req-1",
                link,
                remote_ids=(np.array([1, 2, 3]),),
                local_ids=(np.array([5, 9, 2]),),
                plan=PLAN,
                deadline=loop.time() + deadline_s,
            )
        )
        if cancel_after is not None:
            await asyncio.sleep(cancel_after)
            assert rx.cancel("t1")
        result = await job
        assert not rx.receiving()  # the local lease ends with the push
        return result, seen

    return asyncio.run(go())


async def _written(req: peer_pb2.PushRequest, rx: PushReceiver) -> peer_pb2.PushResponse:
    assert _land(rx, req)
    return peer_pb2.PushResponse(nbytes=8192, descriptors=2)


def test_done_when_the_notification_lands() -> None:
    result, seen = _receive(_written)
    assert result.status is TransferStatus.DONE
    assert result.descriptors == 2 and result.nbytes == PLAN.nbytes
    assert result.invalid_blocks == ()
    (req,) = seen
    assert req.request_id == "req-1" and req.notif_ticket != 0
    assert list(req.local_block_ids.groups[0].ids) == [5, 9, 2]
    assert 0 < req.write_timeout_ms < 2000  # the owner gives up before our deadline


def test_done_even_when_the_notification_beats_the_answer() -> None:
    async def slow_answer(req: peer_pb2.PushRequest, rx: PushReceiver) -> peer_pb2.PushResponse:
        assert _land(rx, req)
        await asyncio.sleep(5)  # the answer never comes in time; the bytes are there
        return peer_pb2.PushResponse()

    result, _ = _receive(slow_answer)
    assert result.status is TransferStatus.DONE
    assert result.invalid_blocks == ()


def _lists_every_block(result: Any) -> None:
    assert [b.tolist() for b in result.invalid_blocks] == [b.tolist() for b in BLOCKS]


def test_owner_refusal_fails_listing_the_blocks() -> None:
    async def refuse(req: peer_pb2.PushRequest, rx: PushReceiver) -> Any:
        raise LeaseRefused("request 'req-1' is no longer held", field="request_id")

    result, _ = _receive(refuse)
    assert result.status is TransferStatus.FAILED
    assert "no longer held" in result.reason
    _lists_every_block(result)


def test_owner_died_mid_write_fails_listing_the_blocks() -> None:
    async def die(req: peer_pb2.PushRequest, rx: PushReceiver) -> Any:
        await asyncio.sleep(0.05)
        raise PeerUnavailable("peer prefill:1 is unreachable")

    result, _ = _receive(die)
    assert result.status is TransferStatus.FAILED
    assert isinstance(result.error, PeerUnavailable)
    _lists_every_block(result)


async def _times_out(req: peer_pb2.PushRequest, rx: PushReceiver) -> Any:
    """A slow owner that keeps its bound: its WRITE is cancelled at its timeout, and it says so."""
    await asyncio.sleep(req.write_timeout_ms / 1000)
    raise DeadlineExceeded("the WRITE outlasted its timeout")


def test_a_slow_owner_expires_listing_the_blocks() -> None:
    result, _ = _receive(_times_out, deadline_s=0.3)
    assert result.status is TransferStatus.EXPIRED
    _lists_every_block(result)


def test_a_stalled_owner_holds_the_push_past_its_deadline_until_it_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An owner stopped mid-WRITE (SIGSTOP, a paused VM) keeps no timeout of its own: its WRITE
    goes on when it resumes, after the pull's deadline. The push must not end (its blocks
    given back to be reused) before that: it ends only once the WRITE is over, here DONE as
    it landed; the log says why it waits."""
    resumed: list[float] = []

    async def stopped(req: peer_pb2.PushRequest, rx: PushReceiver) -> Any:
        await asyncio.sleep(0.6)  # past the pull's 0.3 s deadline
        resumed.append(time.monotonic())
        assert _land(rx, req)
        return peer_pb2.PushResponse(nbytes=8192, descriptors=2)

    with caplog.at_level("WARNING", logger="kvxferd.daemon.receiver"):
        result, _ = _receive(stopped, deadline_s=0.3)
    assert resumed and result.completed_at >= resumed[0]
    assert result.status is TransferStatus.DONE and not result.invalid_blocks
    assert any("no answer from the owner" in r.getMessage() for r in caplog.records)


def test_written_but_never_notified_expires() -> None:
    async def silent(req: peer_pb2.PushRequest, rx: PushReceiver) -> peer_pb2.PushResponse:
        return peer_pb2.PushResponse(nbytes=8192, descriptors=2)

    result, _ = _receive(silent, deadline_s=0.3)
    assert result.status is TransferStatus.EXPIRED
    assert "did not land" in result.reason
    _lists_every_block(result)


def test_cancel_ends_only_once_the_owner_answered() -> None:
    """A cancelled push is not CANCELLED (its blocks reusable) while the owner's WRITE may
    still land: it waits for the owner's answer to the Push call."""
    answered: list[float] = []

    async def slow_write(req: peer_pb2.PushRequest, rx: PushReceiver) -> Any:
        await asyncio.sleep(0.3)  # the WRITE is still running when the cancel comes
        answered.append(time.monotonic())
        return peer_pb2.PushResponse(nbytes=8192, descriptors=2)

    t0 = time.monotonic()
    result, _ = _receive(slow_write, cancel_after=0.05)
    assert result.status is TransferStatus.CANCELLED
    assert answered and time.monotonic() >= answered[0]
    assert answered[0] - t0 >= 0.3
    _lists_every_block(result)


def test_a_cancel_waits_for_the_owners_answer_and_keeps_the_call() -> None:
    """A cancel does not cancel the Push call (its answer is the only word that the WRITE is
    over): the push ends CANCELLED once the owner answered, here at its WRITE timeout."""
    cancelled = asyncio.Event()

    async def slow(req: peer_pb2.PushRequest, rx: PushReceiver) -> Any:
        try:
            return await _times_out(req, rx)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    t0 = time.monotonic()
    result, seen = _receive(slow, deadline_s=0.6, cancel_after=0.05)
    took = time.monotonic() - t0
    assert result.status is TransferStatus.CANCELLED
    (req,) = seen
    assert took >= req.write_timeout_ms / 1000
    assert not cancelled.is_set()
    _lists_every_block(result)


def test_owner_unreachable_fails_after_its_write_timeout() -> None:
    async def gone(req: peer_pb2.PushRequest, rx: PushReceiver) -> Any:
        raise PeerUnavailable("peer prefill:1 is unreachable")

    t0 = time.monotonic()
    result, seen = _receive(gone, deadline_s=0.5)
    (req,) = seen
    assert result.status is TransferStatus.FAILED
    assert time.monotonic() - t0 >= req.write_timeout_ms / 1000
    _lists_every_block(result)


def test_settle_cancels_and_waits_for_every_push() -> None:
    async def go() -> None:
        rx = PushReceiver()
        seen: list[peer_pb2.PushRequest] = []

        async def slow_write(req: peer_pb2.PushRequest, r: PushReceiver) -> Any:
            await asyncio.sleep(0.2)
            return peer_pb2.PushResponse()

        link = _link(slow_write, rx, seen)
        loop = asyncio.get_running_loop()
        jobs = [
            loop.create_task(
                rx.receive(
                    f"t{i}",
                    f"req-{i}",
                    link,
                    remote_ids=(np.array([1]),),
                    local_ids=(np.array([5]),),
                    plan=PLAN,
                    deadline=loop.time() + 5,
                )
            )
            for i in range(3)
        ]
        await asyncio.sleep(0.05)
        assert await rx.settle() == 3
        assert all(j.done() for j in jobs)  # every push ended before settle returned
        assert {j.result().status for j in jobs} == {TransferStatus.CANCELLED}
        assert not rx.receiving() and await rx.settle() == 0

    asyncio.run(go())


@pytest.mark.parametrize(
    ("sender", "ticket_delta", "rid"),
    [("someone-else", 0, "req-1"), (AGENT, 2, "req-1"), (AGENT, 0, "req-2")],
)
def test_a_forged_notification_does_not_complete_a_push(
    sender: str, ticket_delta: int, rid: str
) -> None:
    async def forged(req: peer_pb2.PushRequest, rx: PushReceiver) -> Any:
        fake = peer_pb2.PushRequest(request_id=rid, notif_ticket=req.notif_ticket ^ ticket_delta)
        assert not _land(rx, fake, sender)
        return await _times_out(req, rx)  # nothing landed: the owner's WRITE times out

    result, _ = _receive(forged, deadline_s=0.3)
    assert result.status is TransferStatus.EXPIRED


@given(st.floats(min_value=0.002, max_value=600.0))
def test_the_owner_write_timeout_ends_before_the_pull(left: float) -> None:
    t = write_timeout_s(left)
    assert t < left  # the owner's WRITE is cancelled before this pull can expire
    assert left - t <= 1.0 + 1e-9  # and keeps all but at most a second of it
    if left >= 0.2:  # below, the 50 ms floor of the margin takes more than a quarter
        assert t >= left * 0.75 - 1e-9
