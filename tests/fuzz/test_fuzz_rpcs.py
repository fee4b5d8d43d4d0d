"""Fuzz every RPC of the daemon (Peer, Scheduler on TCP; Engine on the Unix socket) through
real daemons, then prove that a normal pull still moves the right bytes.

For each RPC two tests run: generated messages (Hypothesis strategies built from the protobuf
descriptors, plus mutations of valid requests that get past the first validation) and raw
bodies (bytes that need not decode: random, crafted, damaged encodings). Every call must end
with a status other than INTERNAL and UNKNOWN, and every daemon process must still be alive
after it. A third part has the decode daemon pull from a malicious owner whose every answer is
fuzzed (tests/fuzz/fakepeer.py). The suite fuzzes for ``KVXFERD_FUZZ_SECONDS`` seconds in all
(default 40), shared by weight (harness.WEIGHTS); the counts are printed at the end of the run
and written as JSON to ``KVXFERD_FUZZ_REPORT`` when set. docs/reliability.md has the figures.

What is *not* fuzzed, and why: nothing stops a daemon on purpose over gRPC (there is no
shutdown RPC), so every RPC is fuzzed. Engine.Attach, Session and Detach go mostly to ``att``,
an attached-mode daemon of their own, because they allocate, register and drop the pool; on
the owned-pool pair Attach and Session are refused and Detach(force) only releases held
requests. The fuzz never claims another daemon's NIXL agent name in a handshake (that forgery
is issue 11 item 3's own test and would take the pair's link away mid-run).
"""

from __future__ import annotations

import time
import uuid

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvxferd.v1 import engine_pb2, engine_pb2_grpc, peer_pb2, scheduler_pb2, scheduler_pb2_grpc
from kvxferd.wire.codec import group_ids_to_proto
from tests.fuzz.fakepeer import Answer, FakePeer, Script
from tests.fuzz.harness import (
    BAD_CODES,
    BUDGET,
    STATS,
    WEIGHTS,
    Outcome,
    Rpc,
    all_rpcs,
    budget_s,
    shrink,
)
from tests.fuzz.world import FAKE_PULLS, RPCS, World

RPC_IDS = [r.id for r in all_rpcs()]
CHUNK = 25  # examples per Hypothesis run; runs repeat until the test's time is spent
# No single test may take more than the whole budget (plus slack for start-up and shrinking).
pytestmark = pytest.mark.timeout(int(max(300.0, budget_s() + 240)))


class DaemonDied(Exception):
    pass


def fuzz(world: World, r: Rpc, kind: str, bodies: st.SearchStrategy[bytes], weight: float) -> None:
    """Send bodies drawn from ``bodies`` to ``r`` for the test's share of the budget; record
    every outcome."""
    targets = world.targets(r)
    seconds = BUDGET.share(weight)
    end = time.monotonic() + seconds
    died: list[str] = []

    @settings(
        max_examples=CHUNK,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(body=bodies, target=st.sampled_from(targets), pick=st.integers(0, 63))
    def one(body: bytes, target: tuple[str, str], pick: int) -> None:
        if died or time.monotonic() > end:
            return
        daemon, address = target
        world.before(r)
        meta = world.metadata(r, address, pick)
        out = world.caller.call(r, address, body, metadata=meta)
        if STATS.record(r, kind, address, body, out):
            # A new kind of bad outcome: find a smaller request that fails the same way.
            small = shrink(r, body, out, lambda b: world.caller.call(r, address, b, metadata=meta))
            STATS.shrunk(r.id, kind, out.code, out.details, small)
        world.after(r, daemon, address, body, out)
        gone = world.dead()
        if gone:
            died.extend(gone)
            STATS.fail(r.id, kind, address, "DAEMON_DIED", f"{gone} died after this call", body)

    t0 = time.monotonic()
    try:
        while not died and time.monotonic() < end:
            one()
    finally:
        STATS.seconds[r.id] += time.monotonic() - t0
        BUDGET.spend(weight, time.monotonic() - t0)
    if died:
        raise DaemonDied(f"daemons {died} died while fuzzing {r.id}")


def assert_clean(r: Rpc, kind: str) -> None:
    bad = STATS.failures_of(r.id, kind)
    assert not bad, f"{r.id}: {len(bad)} bad outcomes:\n" + "\n".join(f.repro() for f in bad)


def verified_pull(world: World, remote: list[int], local: list[int]) -> None:
    """Hold on prefill, StartPull on decode, wait DONE, compare kernel-block checksums."""
    engine = engine_pb2_grpc.EngineStub(world.caller.channel(world.unix("prefill")))
    prefill = scheduler_pb2_grpc.SchedulerStub(world.caller.channel(world.tcp("prefill")))
    decode = scheduler_pb2_grpc.SchedulerStub(world.caller.channel(world.tcp("decode")))
    rid = f"verify-{uuid.uuid4().hex[:8]}"
    held = engine.Hold(
        engine_pb2.HoldRequest(request_id=rid, block_ids=group_ids_to_proto([remote])), timeout=10
    )
    started = decode.StartPull(
        scheduler_pb2.StartPullRequest(
            request_id=held.request_id,
            peer_address=held.peer_address,
            remote_block_ids=held.remote_block_ids,
            local_block_ids=group_ids_to_proto([local]),
        ),
        timeout=30,
    )
    tid = started.status.transfer_id
    deadline = time.monotonic() + 60
    while True:
        status = decode.GetTransfer(
            scheduler_pb2.GetTransferRequest(transfer_id=tid), timeout=10
        ).status
        if status.state >= scheduler_pb2.TRANSFER_STATE_DONE or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert status.state == scheduler_pb2.TRANSFER_STATE_DONE, (
        scheduler_pb2.TransferState.Name(status.state),
        status.error.message,
    )

    def digests(stub: scheduler_pb2_grpc.SchedulerStub, ids: list[int]) -> list[bytes]:
        req = scheduler_pb2.ChecksumRequest(group_index=0, block_ids=ids, kernel_block_ids=True)
        return list(stub.Checksum(req, timeout=30).digests)

    kept = remote[len(remote) - len(local) :]
    assert digests(decode, local) == digests(prefill, kept)


def test_a_verified_pull_works_before_fuzzing(world: World) -> None:
    verified_pull(world, [30, 31, 32, 33], [20, 21, 22, 23])


# --- exact repros of the bad outcomes issue 11 names (item 7), on the fresh daemons -----------

U64_CASES = {
    "registrations[0].base_address": lambda p: setattr(p.registrations[0], "base_address", 2**63),
    "registrations[0].nbytes": lambda p: setattr(p.registrations[0], "nbytes", 2**64 - 1),
    "staging.base_address": lambda p: setattr(p.staging, "base_address", 2**64 - 1),
    "staging.chunk_bytes": lambda p: setattr(p.staging, "chunk_bytes", 2**63),
    "spec.regions[0].shape[0]": lambda p: p.spec.regions[0].shape.__setitem__(0, 2**63),
    "spec.regions[0].block_stride": lambda p: setattr(p.spec.regions[0], "block_stride", 2**63),
}


@pytest.mark.parametrize("field", sorted(U64_CASES))
def test_repro_handshake_uint64_over_int64_is_invalid_argument(world: World, field: str) -> None:
    """A handshake payload (otherwise the fuzz agent's valid one) with one uint64 >= 2^63."""
    payload = type(world.payloads[0])()
    payload.CopyFrom(world.payloads[0])
    U64_CASES[field](payload)
    out = world.handshake(world.tcp("prefill"), payload)
    assert out.code == "INVALID_ARGUMENT", (out.code, out.details)


def test_repro_empty_handshake_payload_is_failed_precondition(world: World) -> None:
    req = peer_pb2.HandshakeRequest(protocol_version=1, compat_digest=world.digest, payload=b"")
    out = world.setup_call("Peer.Handshake", world.tcp("prefill"), req)
    assert out.code == "FAILED_PRECONDITION", (out.code, out.details)


@pytest.mark.parametrize("rpc_id", ["Peer.ConfirmLease", "Peer.ExtendLease"])
def test_repro_lease_of_an_unknown_request_is_not_found(world: World, rpc_id: str) -> None:
    """Asked by a handshaken reader (with its session where the contract has sessions)."""
    target = world.tcp("prefill")
    cls = (
        peer_pb2.ConfirmLeaseRequest
        if rpc_id.endswith("ConfirmLease")
        else peer_pb2.ExtendLeaseRequest
    )
    body = cls(request_id="never-held-anywhere", reader_id="r-0", extend_ms=1000)
    meta = world.metadata(RPCS[rpc_id], target, 2)  # a real session, when there are any
    out = world.caller.call(RPCS[rpc_id], target, body.SerializeToString(), metadata=meta)
    assert out.code == "NOT_FOUND", (out.code, out.details)


UNDECODABLE = {
    "corrupt wire format": b"\xff\xff\xff",
    "invalid UTF-8 in a string field": b"\x0a\x01\xff",
}


@pytest.mark.parametrize("body", sorted(UNDECODABLE))
@pytest.mark.parametrize("rpc_id", RPC_IDS)
def test_repro_undecodable_body_is_invalid_argument(world: World, rpc_id: str, body: str) -> None:
    r = RPCS[rpc_id]
    raw = UNDECODABLE[body]
    if body.startswith("invalid UTF-8") and (
        not r.input.fields_by_number.get(1) or r.input.fields_by_number[1].type != 9
    ):
        pytest.skip(f"{r.input.name} has no string field 1")
    daemon, target = world.targets(r)[0]
    out = world.caller.call(r, target, raw)
    assert out.code == "INVALID_ARGUMENT", (daemon, out.code, out.details)


@pytest.mark.parametrize("method", ["Handshake", "ConfirmLease", "ReleaseLease"])
def test_repro_undecodable_answer_of_a_peer(world: World, method: str) -> None:
    """A malicious owner answers one Peer call with bytes that do not decode (the rest of its
    answers valid): the reader's StartPull is not INTERNAL and the pull ends on time."""
    remote, local = FAKE_PULLS[0]
    answers = {k: Answer(v[0].SerializeToString()) for k, v in world.fake_answers(remote).items()}
    answers[method] = Answer(b"\xff")
    peer = FakePeer(Script(answers))
    try:
        req = scheduler_pb2.StartPullRequest(
            request_id="mp",
            peer_address=peer.address,
            remote_block_ids=group_ids_to_proto([remote]),
            local_block_ids=group_ids_to_proto([local]),
            deadline_ms=1000,
        )
        r = RPCS["Scheduler.StartPull"]
        out = world.caller.call(r, world.tcp("decode"), req.SerializeToString(), timeout_s=15)
        assert out.code not in BAD_CODES, (out.code, out.details)
        if out.code == "OK":
            tid = scheduler_pb2.StartPullResponse.FromString(out.body).status.transfer_id
            world.transfers.add(("decode", tid))
            problem = _wait_terminal(world, tid, 1.0 + TERMINAL_SLACK_S)
            assert not problem, problem
    finally:
        peer.stop()


@pytest.mark.parametrize("memory_mode", [-1, 4, 719506326])
def test_repro_attach_with_an_unknown_memory_mode_is_invalid_argument(
    world: World, memory_mode: int
) -> None:
    """Engine.Attach on the attached-mode daemon naming a memory mode the enum does not know
    (proto3 enums are open, so it arrives as itself)."""
    req = engine_pb2.AttachRequest(
        preset="dense:num_blocks=4,num_layers=2", memory_mode=memory_mode
    )
    out = world.caller.call(RPCS["Engine.Attach"], world.unix("att"), req.SerializeToString())
    assert out.code == "INVALID_ARGUMENT", (out.code, out.details)


@pytest.mark.parametrize("deadline_ms", [1, 3])
def test_repro_start_pull_with_a_tiny_deadline_is_not_internal(
    world: World, deadline_ms: int
) -> None:
    """StartPull whose deadline runs out during the handshake (any peer not yet handshaken,
    here an unreachable one): a TimeoutError escaped as INTERNAL until bbb456b (found by this
    fuzz, fixed outside tests/fuzz)."""
    req = scheduler_pb2.StartPullRequest(
        request_id="x", peer_address="127.0.0.1:1", deadline_ms=deadline_ms
    )
    r = RPCS["Scheduler.StartPull"]
    out = world.caller.call(r, world.tcp("decode"), req.SerializeToString())
    assert out.code not in BAD_CODES, (out.code, out.details)


# --- the fuzz ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rpc_id", RPC_IDS)
def test_fuzz_generated_messages(world: World, rpc_id: str) -> None:
    r = RPCS[rpc_id]
    assert not world.dead(), f"daemons {world.dead()} are gone before {rpc_id}"
    fuzz(world, r, "message", world.message_strategy(r), WEIGHTS["test_fuzz_generated_messages"])
    assert_clean(r, "message")


@pytest.mark.parametrize("rpc_id", RPC_IDS)
def test_fuzz_raw_bodies(world: World, rpc_id: str) -> None:
    r = RPCS[rpc_id]
    assert not world.dead(), f"daemons {world.dead()} are gone before {rpc_id}"
    fuzz(world, r, "raw", world.raw_strategy(r), WEIGHTS["test_fuzz_raw_bodies"])
    assert_clean(r, "raw")


MALICIOUS = Rpc(
    "MaliciousPeer",
    "StartPull",
    RPCS["Scheduler.StartPull"].path,
    RPCS["Scheduler.StartPull"].input,
    False,
)
TERMINAL_SLACK_S = 5.0


def test_fuzz_reader_against_a_malicious_peer(world: World) -> None:
    """The decode daemon pulls from a fake owner whose every answer is fuzzed: StartPull must
    not end INTERNAL/UNKNOWN, every accepted pull must reach a terminal state within its
    deadline (plus slack) without an internal error, and the daemon must live."""
    weight = WEIGHTS["test_fuzz_reader_against_a_malicious_peer"]
    seconds = BUDGET.share(weight)
    end = time.monotonic() + seconds
    decode = world.tcp("decode")
    r = RPCS["Scheduler.StartPull"]
    n = [0]

    @settings(
        max_examples=5,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(ex=world.fake_peer_strategy())
    def one(ex: tuple[int, Script]) -> None:
        if time.monotonic() > end or world.dead():
            return
        case, script = ex
        remote, local = FAKE_PULLS[case]
        n[0] += 1
        peer = FakePeer(script)
        try:
            req = scheduler_pb2.StartPullRequest(
                transfer_id=f"mp-{n[0]}-{uuid.uuid4().hex[:6]}",
                request_id="mp",
                peer_address=peer.address,
                remote_block_ids=group_ids_to_proto([remote]),
                local_block_ids=group_ids_to_proto([local]),
                deadline_ms=2000,
            )
            body = req.SerializeToString()
            out = world.caller.call(r, decode, body, timeout_s=15)
            STATS.record(MALICIOUS, "peer", decode, body, _with_script(out, script))
            if out.code == "OK":
                world.transfers.add(("decode", req.transfer_id))
                problem = _wait_terminal(world, req.transfer_id, 2.0 + TERMINAL_SLACK_S)
                if problem:
                    STATS.fail(
                        MALICIOUS.id,
                        "peer",
                        decode,
                        "PULL",
                        problem + "; " + script.describe(),
                        body,
                    )
        finally:
            peer.stop()
        if world.dead():
            STATS.fail(MALICIOUS.id, "peer", decode, "DAEMON_DIED", script.describe(), body)

    t0 = time.monotonic()
    try:
        while time.monotonic() < end and not world.dead():
            one()
    finally:
        STATS.seconds[MALICIOUS.id] += time.monotonic() - t0
        BUDGET.spend(weight, time.monotonic() - t0)
    bad = STATS.failures_of(MALICIOUS.id, "peer")
    assert not bad, "\n".join(f.repro() for f in bad)


def _with_script(out: Outcome, script: Script) -> Outcome:
    """The outcome with the fake peer's answers appended to its details (for the repro)."""
    if out.code not in BAD_CODES:
        return out
    return Outcome(out.code, f"{out.details} [fake peer answers: {script.describe()}]")


def _wait_terminal(world: World, tid: str, within_s: float) -> str:
    """'' once the decode daemon's transfer is terminal without an internal error, else why."""
    deadline = time.monotonic() + within_s
    while True:
        out = world.setup_call(
            "Scheduler.GetTransfer",
            world.tcp("decode"),
            scheduler_pb2.GetTransferRequest(transfer_id=tid),
        )
        if out.code != "OK":
            return f"GetTransfer({tid}) answered {out.code}: {out.details}"
        status = scheduler_pb2.GetTransferResponse.FromString(out.body).status
        if status.state >= scheduler_pb2.TRANSFER_STATE_DONE:
            msg = status.error.message
            if "kvxferd bug" in msg or "internal error" in msg:
                return f"pull ended {scheduler_pb2.TransferState.Name(status.state)}: {msg}"
            return ""
        if time.monotonic() > deadline:
            state = scheduler_pb2.TransferState.Name(status.state)
            return f"pull still {state} {within_s:.0f}s after StartPull (deadline 2s)"
        time.sleep(0.02)


def test_z_daemons_alive_and_a_verified_pull_works_after_fuzzing(world: World) -> None:
    assert not world.dead(), f"daemons {world.dead()} died during the fuzz"
    stuck = world.settle()  # cancel what the fuzz started; what never ends is reported below
    verified_pull(world, [30, 31, 32, 33, 34, 35], [40, 41, 42, 43, 44, 45])
    verified_pull(world, [40, 3, 17, 9, 22], [5, 58, 2, 33, 1])  # fragmented
    verified_pull(world, [7, 8, 9, 10, 11, 12], [50, 51])  # prefix hit
    # The attached-mode daemon still attaches and detaches.
    world.detach_att()
    world.ensure_attached()
    assert world.describe("att").state == engine_pb2.REGISTRATION_STATE_REGISTERED
    world.detach_att()
    assert not world.dead()
    setup = [f for f in STATS.failures.values() if f.kind == "setup"]
    assert not setup, "\n".join(f.repro() for f in setup)
    assert not stuck, f"transfers not terminal {world.SETTLE_S:.0f}s after CancelTransfer: {stuck}"
    problems = world.log_problems()
    assert not problems, f"{len(problems)} log lines say something failed inside:\n" + "\n".join(
        problems[:30]
    )


def test_zz_daemons_stop_cleanly_on_sigterm(world: World) -> None:
    """After all of it, SIGTERM ends every daemon with status 0 within the grace period."""
    problems = world.stop()
    assert not problems, "\n".join(problems)


def test_status_codes_seen_are_real_codes() -> None:
    """The harness's own check: every recorded code is a gRPC code, OK, or an open stream."""
    names = {c.name for c in grpc.StatusCode} | {"OPEN"}
    for rpc_id, codes in STATS.codes.items():
        assert set(codes) <= names, (rpc_id, codes)
