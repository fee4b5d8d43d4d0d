"""Issue 11 regressions through real daemons: per-reader leases, sessions, cancel, heartbeats.

A prefill daemon (pattern-filled) and a decode daemon, both with a short heartbeat timeout so
that a silent reader's share lapses within a test's patience. Raw peers
(:mod:`tests.service.raw_peer`) play second readers, third parties and impostors.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from grpc import aio

from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import common_pb2, engine_pb2, peer_pb2, scheduler_pb2, spec_pb2
from kvxferd.wire.codec import group_ids_to_proto
from kvxferd.wire.errors import detail_from_rpc
from tests.service.conftest import Daemons, launch
from tests.service.raw_peer import RawPeer, describe, handshake
from tests.service.test_service_pull import TERMINAL, Client, run

C = grpc.StatusCode
SPEC = "dense:num_blocks=64"
BLOCK = 32 * 65536
HB = ("--set", "peers.heartbeat_timeout_ms=1500", "--set", "peers.heartbeat_interval_ms=300")


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    ds = launch(
        tmp_path_factory.mktemp("safety"),
        DaemonOptions("prefill", SPEC, fill_seed=11, extra=HB),
        DaemonOptions("decode", SPEC, fill_seed=12, extra=HB),
    )
    yield ds
    ds.stop()


def client(ds: Daemons) -> Client:
    return Client(ds["prefill"], ds["decode"])


async def code_of(call: object) -> C:
    with pytest.raises(aio.AioRpcError) as ei:
        await call  # type: ignore[misc]
    details = ei.value.details() or ""
    assert details, "every refusal says what was wrong"
    return ei.value.code()


class Releases:
    """The prefill engine's release stream, collected in the background."""

    def __init__(self, c: Client, rids: list[str]) -> None:
        self.stream = c.engine.WatchReleases(engine_pb2.WatchReleasesRequest(request_ids=rids))
        self.got: dict[str, engine_pb2.WatchReleasesResponse] = {}
        self.task = asyncio.ensure_future(self._collect())

    async def _collect(self) -> None:
        async for rel in self.stream:
            self.got[rel.request_id] = rel

    async def wait(self, rid: str, timeout_s: float) -> engine_pb2.WatchReleasesResponse:
        deadline = time.monotonic() + timeout_s
        while rid not in self.got:
            assert time.monotonic() < deadline, f"{rid} was not released in {timeout_s}s"
            await asyncio.sleep(0.02)
        return self.got[rid]

    def close(self) -> None:
        self.stream.cancel()
        self.task.cancel()


async def hold(c: Client, rid: str, ids: list[int], readers: int = 1, ttl_ms: int = 0) -> object:
    return await c.engine.Hold(
        engine_pb2.HoldRequest(
            request_id=rid,
            block_ids=group_ids_to_proto([ids]),
            expected_readers=readers,
            ttl_ms=ttl_ms,
        )
    )


def test_a_third_party_cannot_release_a_readers_blocks(daemons: Daemons) -> None:
    """Two readers, one mid-read; a third party that never read calls ReleaseLease and sends a
    forged ticket: the blocks stay held until both confirmed readers are done, and the real
    decode daemon's pull reads exactly the held request's bytes."""

    async def go() -> None:
        c = client(daemons)
        address = daemons["prefill"].grpc
        held = await hold(c, "third-1", [5, 6, 7, 8], readers=2, ttl_ms=30_000)
        rel = Releases(c, ["third-1"])
        reader_a = await handshake(address, SPEC, agent="reader-a")
        third = await handshake(address, SPEC, agent="third-party")
        confirmed = await reader_a.confirm("third-1")
        assert confirmed.ticket and confirmed.instance_id
        assert await code_of(third.release("third-1")) == C.PERMISSION_DENIED
        assert await code_of(third.release("third-1", done=True)) == C.PERMISSION_DENIED
        no_session = RawPeer(reader_a.stub)
        assert await code_of(no_session.release("third-1")) == C.UNAUTHENTICATED
        extend = peer_pb2.ExtendLeaseRequest(request_id="third-1", extend_ms=1000)
        assert await code_of(third.stub.ExtendLease(extend, metadata=third.md)) == (
            C.PERMISSION_DENIED
        )
        await asyncio.sleep(0.3)
        assert "third-1" not in rel.got
        # The second reader, a real daemon, pulls while reader A still holds its share.
        st = await c.pull(held, [20, 21, 22, 23])  # type: ignore[arg-type]
        done = await c.wait(st.transfer_id)
        assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
        assert await c.digests(c.decode, [20, 21, 22, 23]) == await c.digests(
            c.prefill, [5, 6, 7, 8]
        )
        await asyncio.sleep(0.3)
        assert "third-1" not in rel.got, "released while reader A was still reading"
        await reader_a.release("third-1", done=True)
        got = await rel.wait("third-1", 5)
        assert got.reason == 1  # RELEASE_REASON_DONE: both confirmed readers read
        rel.close()

    run(go())


def test_a_silent_reader_frees_its_share_within_the_heartbeat_timeout(daemons: Daemons) -> None:
    """A reader killed mid-pull (it confirmed, then went silent): the owner releases within
    the heartbeat timeout (1.5 s here), not the 60 s lease TTL. Heartbeats keep a share."""

    async def go() -> None:
        c = client(daemons)
        address = daemons["prefill"].grpc
        await hold(c, "silent-1", [30], ttl_ms=60_000)
        await hold(c, "beating-1", [31], ttl_ms=60_000)
        rel = Releases(c, ["silent-1", "beating-1"])
        silent = await handshake(address, SPEC, agent="silent")
        beating = await handshake(address, SPEC, agent="beating")
        t0 = time.monotonic()
        await silent.confirm("silent-1", extend_ms=60_000)
        await beating.confirm("beating-1", extend_ms=60_000)
        while time.monotonic() - t0 < 3.0:  # twice the timeout, heartbeating every 0.4 s
            hb = await beating.heartbeat(["beating-1"], renew_ms=10**9)
            assert list(hb.lost_request_ids) == []  # renew_ms is clamped, never "lost"
            assert 0 < hb.renewed_ms <= 1500
            await asyncio.sleep(0.4)
        await rel.wait("silent-1", 2.0)
        assert time.monotonic() - t0 < 5.0
        assert "beating-1" not in rel.got
        lost = await beating.heartbeat(["beating-1", "never-held"], renew_ms=1000)
        assert list(lost.lost_request_ids) == ["never-held"]
        await beating.release("beating-1")
        assert (await rel.wait("beating-1", 5)).reason == 3  # CANCELLED: it gave up
        rel.close()

    run(go())


def test_an_impostor_cannot_take_a_live_readers_name(daemons: Daemons) -> None:
    async def go() -> None:
        c = client(daemons)
        address = daemons["prefill"].grpc
        await hold(c, "victim-1", [40], ttl_ms=30_000)
        victim = await handshake(address, SPEC, agent="victim", instance="v1")
        await victim.confirm("victim-1")
        with pytest.raises(aio.AioRpcError) as ei:
            await handshake(address, SPEC, agent="victim", instance="impostor")
        assert ei.value.code() == C.FAILED_PRECONDITION
        assert "victim" in (ei.value.details() or "")
        # The same instance again (another address of one daemon) gets its own session and
        # disturbs nothing.
        alias = await handshake(address, SPEC, agent="victim", instance="v1")
        assert alias.session != victim.session
        await victim.heartbeat(["victim-1"], 1000)
        await victim.release("victim-1", done=True)
        # Once the victim reads nothing, a new instance of that name is a restart: accepted,
        # and the old instance's sessions end (it must handshake again).
        await handshake(address, SPEC, agent="victim", instance="v2")
        with pytest.raises(aio.AioRpcError) as ei:
            await victim.heartbeat([], 0)
        assert ei.value.code() == C.UNAUTHENTICATED
        detail = detail_from_rpc(ei.value)  # the structured trailer names the kind
        assert detail is not None and detail.kind == common_pb2.ERROR_KIND_UNKNOWN_SESSION
        assert "handshake again" in detail.fix

    run(go())


@pytest.mark.slow
def test_cancels_racing_the_lease_confirmation_never_write_unlisted_blocks(
    daemons: Daemons,
) -> None:
    """Many StartPull + CancelTransfer pairs, the cancel landing anywhere from before the
    confirmation to after the READ: a CANCELLED pull that lists no block wrote none (checked
    after the dust settles), and its owner lease never ends DONE."""

    async def go() -> None:
        c = client(daemons)
        rng = random.Random(7)
        local = [60, 61]
        rids = [f"race-{i}" for i in range(40)]
        rel = Releases(c, rids)
        outcomes: dict[str, int] = {}
        for i, rid in enumerate(rids):
            remote = [(2 * i) % 56, (2 * i + 1) % 56]
            held = await hold(c, rid, remote, ttl_ms=3_000)
            before = await c.digests(c.decode, local)
            st = await c.pull(held, local)  # type: ignore[arg-type]
            await asyncio.sleep(rng.choice([0, 0, 0.0005, 0.001, 0.002, 0.005]))
            got = await c.decode.CancelTransfer(
                scheduler_pb2.CancelTransferRequest(transfer_id=st.transfer_id)
            )
            final = got.status
            if final.state not in TERMINAL:
                final = await c.wait(st.transfer_id)
            await asyncio.sleep(0.05)  # a stray READ would land by now
            after = await c.digests(c.decode, local)
            listed = (
                sorted(final.invalid_local_block_ids.groups[0].ids)
                if (final.invalid_local_block_ids.groups)
                else []
            )
            outcomes[final.state] = outcomes.get(final.state, 0) + 1
            if final.state == scheduler_pb2.TRANSFER_STATE_CANCELLED and not listed:
                assert after == before, f"{rid}: CANCELLED listing nothing, yet blocks changed"
                assert "no local block was written" in final.error.message
            elif final.state == scheduler_pb2.TRANSFER_STATE_CANCELLED:
                assert listed == sorted(local)
            elif final.state == scheduler_pb2.TRANSFER_STATE_DONE:
                assert after == await c.digests(c.prefill, remote)
            if final.state != scheduler_pb2.TRANSFER_STATE_DONE:
                r = await rel.wait(rid, 10)
                assert r.reason != 1, f"{rid}: the owner counted a cancelled pull as DONE"
        assert outcomes.get(scheduler_pb2.TRANSFER_STATE_CANCELLED, 0) >= 5, outcomes
        rel.close()

    run(go())


def test_contract_details(daemons: Daemons) -> None:
    async def go() -> None:
        c = client(daemons)
        address = daemons["prefill"].grpc
        rp = await handshake(address, SPEC, agent="contract")
        # ConfirmLease / ExtendLease of a request never held: NOT_FOUND.
        assert await code_of(rp.confirm("never-held")) == C.NOT_FOUND
        ext = peer_pb2.ExtendLeaseRequest(request_id="never-held", extend_ms=10)
        assert await code_of(rp.stub.ExtendLease(ext, metadata=rp.md)) == C.NOT_FOUND
        await hold(c, "contract-1", [50])
        await rp.confirm("contract-1")
        zero = peer_pb2.ExtendLeaseRequest(request_id="contract-1", extend_ms=0)
        assert await code_of(rp.stub.ExtendLease(zero, metadata=rp.md)) == C.INVALID_ARGUMENT
        await rp.release("contract-1")
        # A request ID no notification could carry is refused at Hold.
        assert await code_of(hold(c, "x" * 1025, [51])) == C.INVALID_ARGUMENT
        # A deadline longer than the longest lease is refused at StartPull.
        held = await hold(c, "contract-2", [52])
        long = c.decode.StartPull(
            scheduler_pb2.StartPullRequest(
                request_id="contract-2",
                peer_address=held.peer_address,  # type: ignore[attr-defined]
                remote_block_ids=held.remote_block_ids,  # type: ignore[attr-defined]
                local_block_ids=group_ids_to_proto([[52]]),
                deadline_ms=3_600_000,
            )
        )
        assert await code_of(long) == C.INVALID_ARGUMENT
        # Handshakes: empty payload is a refusal; uint64 >= 2^63 is a bad argument.
        empty = peer_pb2.HandshakeRequest(protocol_version=1, compat_digest=b"x", payload=b"")
        assert await code_of(rp.stub.Handshake(empty)) == C.FAILED_PRECONDITION
        me = describe(SPEC, "huge", "huge")
        version, digest, payload = me.envelope()
        msg = peer_pb2.HandshakePayload.FromString(payload)
        msg.registrations[0].CopyFrom(
            spec_pb2.RegionRegistration(region_name="x", base_address=2**63, nbytes=1)
        )
        bad = peer_pb2.HandshakeRequest(
            protocol_version=version, compat_digest=digest, payload=msg.SerializeToString()
        )
        assert await code_of(rp.stub.Handshake(bad)) == C.INVALID_ARGUMENT

    run(go())


async def _collect(stream: AsyncIterator[scheduler_pb2.WatchTransfersResponse]) -> list[int]:
    return [msg.status.state async for msg in stream]


def test_watch_named_ends_and_watch_all_starts_with_a_snapshot(daemons: Daemons) -> None:
    async def go() -> None:
        c = client(daemons)
        held = await hold(c, "watch-1", [53])
        st = await c.pull(held, [53])  # type: ignore[arg-type]
        named = c.decode.WatchTransfers(
            scheduler_pb2.WatchTransfersRequest(transfer_ids=[st.transfer_id])
        )
        states = await asyncio.wait_for(_collect(named), 20)  # ends by itself
        assert states[-1] == scheduler_pb2.TRANSFER_STATE_DONE
        everything = c.decode.WatchTransfers(scheduler_pb2.WatchTransfersRequest())
        first = await asyncio.wait_for(everything.read(), 5)
        assert first.status.transfer_id  # a snapshot of an existing pull, without new activity
        everything.cancel()

    run(go())


def test_two_pulls_of_one_request_never_read_under_one_share(daemons: Daemons) -> None:
    """An owner gives a decode daemon one share of a request, whatever number of pulls it runs
    (kvxferd/daemon/claims.py). A second pull of the same request while the first reads would
    read under that share, and the first to end (a full prefix hit ends at once) would release
    the blocks under the other. So the second pull is refused, naming the first: while it
    reads, and after it read (the owner would refuse a second read by the same reader). The
    first pull reads exactly the held bytes, and the blocks are released once, after it."""

    async def go() -> None:
        c = client(daemons)
        held = await hold(c, "dup-1", list(range(40, 64)), ttl_ms=30_000)
        rel = Releases(c, ["dup-1"])
        first = await c.pull(held, list(range(0, 24)), transfer_id="dup-first")  # type: ignore[arg-type]
        assert first.transfer_id == "dup-first"
        for tid, local in (("dup-hit", []), ("dup-second", list(range(24, 48)))):
            with pytest.raises(aio.AioRpcError) as ei:
                await c.pull(held, local, transfer_id=tid)  # type: ignore[arg-type]
            assert ei.value.code() is C.FAILED_PRECONDITION
            assert "dup-first" in (ei.value.details() or "")  # the pull to wait for
        done = await c.wait("dup-first")
        assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
        assert await c.digests(c.decode, list(range(0, 24))) == await c.digests(
            c.prefill, list(range(40, 64))
        )
        got = await rel.wait("dup-1", 5)
        assert got.reason == 1  # RELEASE_REASON_DONE, once the first pull had read
        with pytest.raises(aio.AioRpcError) as ei:
            await c.pull(held, [], transfer_id="dup-after")  # type: ignore[arg-type]
        assert ei.value.code() is C.FAILED_PRECONDITION
        assert "already ended its share" in (ei.value.details() or "")
        rel.close()

    run(go())


def test_twin_start_pulls_of_one_transfer_confirm_once_and_answer_with_one_pull(
    daemons: Daemons,
) -> None:
    """Identical StartPulls (same transfer ID) arriving together: one pull runs and every call
    answers with it (scheduler.proto: an identical retry returns the existing transfer); its
    bytes are the held ones, and the owner releases the blocks once, as read (a twin that gave
    back the share would have ended it under the running pull)."""

    async def go() -> None:
        c = client(daemons)
        held = await hold(c, "twin-1", [1, 2, 3], ttl_ms=30_000)
        rel = Releases(c, ["twin-1"])
        req = scheduler_pb2.StartPullRequest(
            transfer_id="twin-t",
            request_id=held.request_id,  # type: ignore[attr-defined]
            peer_address=held.peer_address,  # type: ignore[attr-defined]
            remote_block_ids=held.remote_block_ids,  # type: ignore[attr-defined]
            local_block_ids=group_ids_to_proto([[40, 41, 42]]),
        )
        answers = await asyncio.gather(*(c.decode.StartPull(req) for _ in range(4)))
        assert {a.status.transfer_id for a in answers} == {"twin-t"}
        assert sum(a.created for a in answers) == 1
        done = await c.wait("twin-t")
        assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
        assert await c.digests(c.decode, [40, 41, 42]) == await c.digests(c.prefill, [1, 2, 3])
        assert (await rel.wait("twin-1", 5)).reason == 1  # released once read: DONE
        rel.close()

    run(go())
