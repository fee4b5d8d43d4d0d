"""DeclinePull between real daemons (scheduler.proto; kvxferd/daemon/decline.py): a decode
daemon that will not pull a held request after all gives up its place in the prefill daemon's
lease, and the prefill engine gets its blocks back at once instead of at the lease's TTL.

A prefill daemon and a decode daemon (the decode one also serving its scheduler socket); raw
peers (:mod:`tests.service.raw_peer`) play the other readers of a request.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvxferd.client import Declined, KvxferdRpcError, SchedulerClient
from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.scenario.ports import free_port
from kvxferd.v1 import common_pb2, scheduler_pb2
from kvxferd.wire.codec import group_ids_to_proto
from tests.push.conftest import mode_config
from tests.service.conftest import Daemons, launch
from tests.service.raw_peer import handshake
from tests.service.test_safety import Releases, code_of, hold
from tests.service.test_service_pull import Client, run

C = grpc.StatusCode
SPEC = "dense:num_blocks=32"
LONG_TTL_MS = 60_000  # a decline must free the blocks long before this


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    ds = launch(
        tmp_path_factory.mktemp("decline"),
        DaemonOptions("prefill", SPEC, fill_seed=5),
        DaemonOptions("decode", SPEC, scheduler_socket=True),
    )
    yield ds
    ds.stop()


def decline(c: Client, rid: str, address: str) -> object:
    return c.decode.DeclinePull(
        scheduler_pb2.DeclinePullRequest(request_id=rid, peer_address=address), timeout=10
    )


def test_a_decline_frees_the_held_blocks_at_once_and_refuses_a_later_pull(
    daemons: Daemons,
) -> None:
    async def go() -> None:
        c = Client(daemons["prefill"], daemons["decode"])
        address = daemons["prefill"].grpc
        await hold(c, "dec-1", [1, 2, 3], readers=1, ttl_ms=LONG_TTL_MS)
        rel = Releases(c, ["dec-1"])
        try:
            t0 = time.monotonic()
            resp = await decline(c, "dec-1", address)
            assert resp.released and resp.readers_expected == 1 and resp.readers_confirmed == 1
            got = await rel.wait("dec-1", 10)
            assert got.reason == common_pb2.RELEASE_REASON_CANCELLED
            assert time.monotonic() - t0 < 10  # not the 60 s TTL
        finally:
            rel.close()
        # The same decline again is answered, not refused (the vLLM connector may repeat it).
        again = await decline(c, "dec-1", address)
        assert again.released
        # A pull of a request this daemon declined is refused here, saying so.
        start = c.decode.StartPull(
            scheduler_pb2.StartPullRequest(
                request_id="dec-1",
                peer_address=address,
                remote_block_ids=group_ids_to_proto([[1, 2, 3]]),
                local_block_ids=group_ids_to_proto([[4, 5, 6]]),
            )
        )
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await start
        assert ei.value.code() == C.FAILED_PRECONDITION
        assert "declined" in (ei.value.details() or "")

    run(go())


def test_a_decline_waits_for_the_reader_still_reading(daemons: Daemons) -> None:
    """Two expected readers: one confirmed and reading, the decode daemon declines. The blocks
    stay held until the reading one ends, then are released."""

    async def go() -> None:
        c = Client(daemons["prefill"], daemons["decode"])
        address = daemons["prefill"].grpc
        await hold(c, "dec-2", [7, 8], readers=2, ttl_ms=LONG_TTL_MS)
        rel = Releases(c, ["dec-2"])
        try:
            reading = await handshake(address, SPEC, agent="reader-a", instance="dec-a")
            assert (await reading.confirm("dec-2", extend_ms=20_000)).ticket
            resp = await decline(c, "dec-2", address)
            assert not resp.released
            assert (resp.readers_expected, resp.readers_confirmed) == (2, 2)
            await asyncio.sleep(0.3)
            assert "dec-2" not in rel.got, "released under a reader still reading"
            await reading.release("dec-2", done=True)
            got = await rel.wait("dec-2", 10)
            assert got.reason == common_pb2.RELEASE_REASON_CANCELLED  # not every reader read
        finally:
            rel.close()

    run(go())


def test_refusals_say_what_was_wrong(daemons: Daemons) -> None:
    async def go() -> None:
        c = Client(daemons["prefill"], daemons["decode"])
        address = daemons["prefill"].grpc
        assert await code_of(decline(c, "", address)) == C.INVALID_ARGUMENT
        assert await code_of(decline(c, "dec-x", "")) == C.INVALID_ARGUMENT
        assert await code_of(decline(c, "never-held", address)) == C.NOT_FOUND
        # Every place taken by another reader: nothing to decline, and nothing is released.
        await hold(c, "dec-3", [9], readers=1, ttl_ms=LONG_TTL_MS)
        other = await handshake(address, SPEC, agent="reader-b", instance="dec-b")
        await other.confirm("dec-3", extend_ms=20_000)
        assert await code_of(decline(c, "dec-3", address)) == C.FAILED_PRECONDITION
        # A pull of this daemon that read the request ended its share: a decline is refused.
        held = await c.hold("dec-4", [10, 11])
        status = await c.pull(held, [12, 13])
        status = await c.wait(status.transfer_id)
        assert status.state == scheduler_pb2.TRANSFER_STATE_DONE, status.error.message
        assert await code_of(decline(c, "dec-4", held.peer_address)) == C.FAILED_PRECONDITION
        late = scheduler_pb2.DeclinePullRequest(
            request_id="dec-x", peer_address=address, deadline_ms=10_000_000
        )
        assert await code_of(c.decode.DeclinePull(late)) == C.INVALID_ARGUMENT

    run(go())


def test_a_decline_of_a_lease_that_lapsed_at_its_ttl_is_answered_released(
    daemons: Daemons,
) -> None:
    """A helper's review: a decline of a request whose lease the owner had already released
    was refused FAILED_PRECONDITION with a missing lease's "do not read: re-run the prefill",
    though nothing was held for this daemon any more (all a decline asks)."""

    async def go() -> None:
        c = Client(daemons["prefill"], daemons["decode"])
        address = daemons["prefill"].grpc
        held = await hold(c, "dec-8", [24, 25], readers=1, ttl_ms=1000)
        rel = Releases(c, ["dec-8"])
        try:
            got = await rel.wait("dec-8", 10)
            assert got.reason == common_pb2.RELEASE_REASON_EXPIRED
        finally:
            rel.close()
        resp = await decline(c, "dec-8", address)
        assert resp.released and (resp.readers_expected, resp.readers_confirmed) == (0, 0)
        assert (await decline(c, "dec-8", address)).released  # a repeat too
        pull = scheduler_pb2.StartPullRequest(
            request_id="dec-8",
            peer_address=address,
            remote_block_ids=held.remote_block_ids,  # type: ignore[attr-defined]
            local_block_ids=group_ids_to_proto([[26, 27]]),
        )
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await c.decode.StartPull(pull)  # declined here: refused here, saying so
        assert ei.value.code() == C.FAILED_PRECONDITION
        assert "declined" in (ei.value.details() or "")

    run(go())


def test_a_decline_after_the_other_reader_ended_the_lease_is_answered_released(
    daemons: Daemons,
) -> None:
    """Another reader took the only expected place and read: the lease ended DONE. A decline
    by this daemon, which never read it, is answered released."""

    async def go() -> None:
        c = Client(daemons["prefill"], daemons["decode"])
        address = daemons["prefill"].grpc
        await hold(c, "dec-9", [28, 29], readers=1, ttl_ms=LONG_TTL_MS)
        rel = Releases(c, ["dec-9"])
        try:
            other = await handshake(address, SPEC, agent="reader-c", instance="dec-c")
            assert (await other.confirm("dec-9", extend_ms=20_000)).ticket
            await other.release("dec-9", done=True)
            got = await rel.wait("dec-9", 10)
            assert got.reason == common_pb2.RELEASE_REASON_DONE
            resp = await decline(c, "dec-9", address)
            assert resp.released and (resp.readers_expected, resp.readers_confirmed) == (0, 0)
        finally:
            rel.close()

    run(go())


def test_a_decline_of_a_request_never_held_is_still_refused_saying_so(daemons: Daemons) -> None:
    async def go() -> None:
        c = Client(daemons["prefill"], daemons["decode"])
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await decline(c, "dec-never-held", daemons["prefill"].grpc)  # type: ignore[misc]
        assert ei.value.code() == C.NOT_FOUND
        details = ei.value.details() or ""
        assert "'dec-never-held' is not held here" in details and "must Hold" in details

    run(go())


def test_the_client_declines_over_the_scheduler_socket(daemons: Daemons) -> None:
    decode = daemons["decode"]
    address = daemons["prefill"].grpc

    async def held() -> None:
        c = Client(daemons["prefill"], decode)
        await hold(c, "dec-5", [14, 15], readers=1, ttl_ms=LONG_TTL_MS)

    run(held())
    ready = daemons.set["decode"].ready
    assert ready is not None and ready.scheduler_socket, "the fixture serves it"
    with SchedulerClient(decode.grpc, socket=ready.scheduler_socket) as client:
        out = client.decline_pull(request_id="dec-5", peer_address=address)
        assert out == Declined(released=True, readers_expected=1, readers_confirmed=1)
        with pytest.raises(KvxferdRpcError) as ei:
            client.decline_pull(request_id="never-held-5", peer_address=address)
        assert ei.value.code is C.NOT_FOUND


def test_a_decline_in_flight_or_of_unknown_outcome_keeps_this_daemon_off_the_request(
    daemons: Daemons,
) -> None:
    """A helper's review: two concurrent declines shared one claim, and the first to fail let a
    pull of the request in while the other was still on its way to the owner (which could end
    the pull's share under its READ). Now a second decline in flight is refused, and a decline
    whose outcome is unknown (it timed out while the owner was stopped) keeps every later pull
    of the request off for good; a repeat, once the owner answers, is idempotent."""
    pid = daemons.set["prefill"].ready.pid  # type: ignore[union-attr]

    async def go() -> None:
        c = Client(daemons["prefill"], daemons["decode"])
        address = daemons["prefill"].grpc
        held = await hold(c, "dec-6", [16, 17], readers=1, ttl_ms=LONG_TTL_MS)
        pull = scheduler_pb2.StartPullRequest(
            request_id="dec-6",
            peer_address=address,
            remote_block_ids=held.remote_block_ids,  # type: ignore[attr-defined]
            local_block_ids=group_ids_to_proto([[18, 19]]),
        )

        def slow(ms: int) -> object:
            req = scheduler_pb2.DeclinePullRequest(
                request_id="dec-6", peer_address=address, deadline_ms=ms
            )
            return c.decode.DeclinePull(req, timeout=20)

        os.kill(pid, signal.SIGSTOP)
        try:
            first = asyncio.ensure_future(slow(600))
            await asyncio.sleep(0.2)
            with pytest.raises(grpc.aio.AioRpcError) as second:
                await slow(5000)
            assert second.value.code() == C.FAILED_PRECONDITION
            assert "in flight" in (second.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as during:
                await c.decode.StartPull(pull)
            assert "being declined" in (during.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as timed_out:
                await first
            assert timed_out.value.code() == C.DEADLINE_EXCEEDED
            with pytest.raises(grpc.aio.AioRpcError) as after:
                await c.decode.StartPull(pull)  # the decline may have reached the owner
            assert after.value.code() == C.FAILED_PRECONDITION
            assert "declined" in (after.value.details() or "")
        finally:
            os.kill(pid, signal.SIGCONT)
        again = await slow(10_000)
        assert again.released

    run(go())


def test_a_decline_after_the_owner_restarted_handshakes_again(tmp_path: Path) -> None:
    """A helper's review: after the prefill daemon restarted at the same address, DeclinePull
    failed UNAUTHENTICATED (the old session) until some pull handshook again."""
    port = free_port()
    prefill = DaemonOptions("prefill", SPEC, fill_seed=5, extra=("--listen", f"127.0.0.1:{port}"))
    for sub in ("a", "b", "d"):
        (tmp_path / sub).mkdir()
    owners = launch(tmp_path / "a", prefill)
    decoders = launch(tmp_path / "d", DaemonOptions("decode", SPEC))

    async def declined(rid: str) -> bool:
        c = Client(owners["prefill"], decoders["decode"])
        await hold(c, rid, [1, 2], readers=1, ttl_ms=LONG_TTL_MS)
        return bool((await decline(c, rid, owners["prefill"].grpc)).released)

    try:
        assert run(declined("dec-r1"))
        owners.stop()
        owners = launch(tmp_path / "b", prefill)
        assert run(declined("dec-r2"))
    finally:
        decoders.stop()
        owners.stop()


def test_a_decline_after_a_push_pull_read_the_request_is_refused_here(tmp_path: Path) -> None:
    """A helper's review: in push mode a DONE pull's share has no ticket, so its claim was
    released as if the share were kept, and a decline went on to the owner, where (before the
    owner's Push handler ended the share) it could turn a completed WRITE into a give-up."""
    on = mode_config(tmp_path, "push")
    ds = launch(
        tmp_path,
        DaemonOptions("prefill", SPEC, fill_seed=5, extra=on),
        DaemonOptions("decode", SPEC, extra=on),
    )

    async def go() -> None:
        c = Client(ds["prefill"], ds["decode"])
        held = await c.hold("dec-p", [3, 4])
        status = await c.wait((await c.pull(held, [5, 6])).transfer_id)
        assert status.state == scheduler_pb2.TRANSFER_STATE_DONE, status.error.message
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await decline(c, "dec-p", held.peer_address)
        assert ei.value.code() == C.FAILED_PRECONDITION
        assert status.transfer_id in (ei.value.details() or "")  # refused here, naming it

    try:
        run(go())
    finally:
        ds.stop()


def test_a_decline_while_a_pull_of_the_request_runs_says_to_cancel_it(daemons: Daemons) -> None:
    pid = daemons.set["prefill"].ready.pid  # type: ignore[union-attr]

    async def go() -> None:
        c = Client(daemons["prefill"], daemons["decode"])
        held = await c.hold("dec-7", [20, 21])
        os.kill(pid, signal.SIGSTOP)  # the pull waits for its confirmation
        try:
            started = await c.pull(held, [22, 23])
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await decline(c, "dec-7", held.peer_address)
            assert ei.value.code() == C.FAILED_PRECONDITION
            details = ei.value.details() or ""
            assert started.transfer_id in details and "CancelTransfer" in details
        finally:
            os.kill(pid, signal.SIGCONT)
        status = await c.wait(started.transfer_id)
        assert status.state == scheduler_pb2.TRANSFER_STATE_DONE, status.error.message

    run(go())
