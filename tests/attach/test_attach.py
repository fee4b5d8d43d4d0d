"""Attached pools over real daemons: an engine process attaches (OWNED or IMPORTED shared
memory), stamps its blocks and holds; a second daemon pulls; bytes are compared with Checksum.
The engine is killed with SIGKILL: the daemon survives, detaches, releases with reason
ENGINE_DETACHED, refuses pulls, and takes a restarted engine's attach."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvxferd.engine import EngineClient, shared_tensors
from kvxferd.errors import AlreadyExists, SpecError, StateConflict
from kvxferd.layout.presets import preset
from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from kvxferd.wire.codec import group_ids_to_proto
from kvxferd.wire.errors import detail_from_rpc
from tests.lineproc import LineProcess
from tests.service.conftest import Daemon, launch

PRESET = "dense:num_blocks=64"
TERMINAL = {
    scheduler_pb2.TRANSFER_STATE_DONE,
    scheduler_pb2.TRANSFER_STATE_FAILED,
    scheduler_pb2.TRANSFER_STATE_CANCELLED,
    scheduler_pb2.TRANSFER_STATE_EXPIRED,
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    """An attached daemon (no pool until an engine attaches) and an owned decode daemon."""
    ds = launch(
        tmp_path_factory.mktemp("attach"),
        DaemonOptions("att", PRESET, extra=("--set", "pool.mode=attached")),
        DaemonOptions("decode", PRESET),
    )
    yield ds["att"], ds["decode"]
    ds.stop()


class Engine(LineProcess):
    """A test engine process (tests/attach/engine_proc.py)."""

    def __init__(self, socket: str, *args: str) -> None:
        super().__init__("tests.attach.engine_proc", socket, *args)

    def detach(self) -> dict[str, Any]:
        self.send("detach")
        out = self.line()
        assert self.proc.wait(30) == 0, self.err.read_text()[-3000:]
        self.kill()
        return out


def _sched(addr: str) -> scheduler_pb2_grpc.SchedulerStub:
    return scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(addr))


def _engine_stub(d: Daemon) -> engine_pb2_grpc.EngineStub:
    return engine_pb2_grpc.EngineStub(grpc.insecure_channel(f"unix:{d.engine_socket}"))


def _digests(addr: str, ids: list[int]) -> list[bytes]:
    resp = _sched(addr).Checksum(
        scheduler_pb2.ChecksumRequest(group_index=0, block_ids=ids, kernel_block_ids=True)
    )
    return list(resp.digests)


def _pull(decode: Daemon, ticket: dict[str, Any], local: list[int]) -> scheduler_pb2.TransferStatus:
    stub = _sched(decode.grpc)
    st = stub.StartPull(
        scheduler_pb2.StartPullRequest(
            request_id=ticket["request_id"],
            peer_address=ticket["peer_address"],
            remote_block_ids=group_ids_to_proto(ticket["remote_block_ids"]),
            local_block_ids=group_ids_to_proto([local]),
            deadline_ms=20_000,
        )
    ).status
    for msg in stub.WatchTransfers(
        scheduler_pb2.WatchTransfersRequest(transfer_ids=[st.transfer_id])
    ):
        if msg.status.state in TERMINAL:
            return msg.status
    raise AssertionError("watch ended without a terminal state")


def _pull_and_verify(att: Daemon, decode: Daemon, ticket: dict[str, Any], local: list[int]) -> None:
    remote = ticket["remote_block_ids"][0]
    before = _digests(decode.grpc, local)
    done = _pull(decode, ticket, local)
    assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
    assert _digests(decode.grpc, local) == _digests(att.grpc, remote)
    assert _digests(decode.grpc, local) != before


def _state(d: Daemon) -> engine_pb2.PoolInfo:
    return _engine_stub(d).Describe(engine_pb2.DescribeRequest()).pool


@pytest.mark.parametrize("mode", ["owned", "imported"])
def test_engine_writes_shared_memory_and_a_peer_pulls_it(
    pair: tuple[Daemon, Daemon], mode: str
) -> None:
    att, decode = pair
    seed = 7 if mode == "owned" else 8
    eng = Engine(att.engine_socket, "--mode", mode, "--seed", str(seed), "--request", mode)
    try:
        out = eng.line()
        pool = _state(att)
        assert pool.state == engine_pb2.REGISTRATION_STATE_REGISTERED
        assert pool.attachment_id == out["attachment_id"]
        assert pool.memory_mode == (
            engine_pb2.MEMORY_MODE_OWNED if mode == "owned" else engine_pb2.MEMORY_MODE_IMPORTED
        )
        names = [h.shm_name for h in pool.exports]
        if mode == "owned":
            assert names and all(n.startswith("/kvxferd-") for n in names)
            assert all(Path("/dev/shm", n.lstrip("/")).exists() for n in names)
        _pull_and_verify(att, decode, out["ticket"], [20, 21, 22, 23])
        assert eng.detach() == {"detached": 0}
        assert _state(att).state == engine_pb2.REGISTRATION_STATE_DETACHED
        # The daemon unlinked the segments it created.
        assert not [n for n in names if Path("/dev/shm", n.lstrip("/")).exists()]
    finally:
        eng.kill()


@pytest.mark.slow
def test_attach_refusals_say_what_was_wrong(pair: tuple[Daemon, Daemon]) -> None:
    att, _ = pair
    with EngineClient(att.engine_socket) as client:
        # IMPORTED memory that does not match the spec it claims: too small, wrong shape.
        small = shared_tensors(preset("dense:num_blocks=32"))
        # The daemon's own class comes back (SpecError: the memory does not fit the spec).
        with pytest.raises(SpecError, match=r"needs 4194304 bytes .* has 2097152"):
            client.attach(PRESET, "imported", tensors=small)
        big = shared_tensors(preset("dense:num_blocks=128"))
        with pytest.raises(SpecError, match=r"do not match the spec.*expected.*64"):
            client.attach(PRESET, "imported", tensors=big)
        assert client.describe().state == "DETACHED"
        # A second Attach while one is attached.
        eng = Engine(att.engine_socket, "--request", "refusals")
        try:
            eng.line()
            with pytest.raises(AlreadyExists, match="already attached"):
                client.attach(PRESET)
        finally:
            eng.detach()


@pytest.mark.slow
def test_ending_an_attachment_leaves_no_thread_inside_grpc(pair: tuple[Daemon, Daemon]) -> None:
    """Detach, and closing the client with an attachment still attached, return only once
    the session's thread has left its gRPC stream: a process exiting with a thread inside a
    gRPC call can abort in gRPC's native teardown."""
    att, _ = pair
    with EngineClient(att.engine_socket) as client:
        first = client.attach(PRESET)
        assert first._thread is not None and first._thread.is_alive()
        first.detach()
        assert not first._thread.is_alive()
    client = EngineClient(att.engine_socket)
    second = client.attach(PRESET)
    assert second._thread is not None and second._thread.is_alive()
    client.close()
    assert not second.attached and not second._thread.is_alive()
    assert second.end_reason == "the engine client was closed"
    deadline = time.monotonic() + 10
    while _state(att).state != engine_pb2.REGISTRATION_STATE_DETACHED:  # the daemon saw it go
        assert time.monotonic() < deadline, "the daemon kept the closed client's pool"
        time.sleep(0.05)


@pytest.mark.slow
def test_killed_engine_is_detached_and_a_restarted_one_reattaches(
    pair: tuple[Daemon, Daemon],
) -> None:
    att, decode = pair
    eng = Engine(att.engine_socket, "--request", "doomed", "--blocks", "4,5,6")
    try:
        first = eng.line()
        gen = _state(att).registration_generation
        releases = _engine_stub(att).WatchReleases(
            engine_pb2.WatchReleasesRequest(request_ids=["doomed"])
        )
        releases.initial_metadata()  # registered before the engine dies
        eng.kill()
        rel = next(iter(releases))
        assert rel.request_id == "doomed"
        assert rel.reason == common_pb2.RELEASE_REASON_ENGINE_DETACHED
        releases.cancel()
        pool = _state(att)
        assert pool.state == engine_pb2.REGISTRATION_STATE_DETACHED
        assert pool.registration_generation > gen
        # A pull of the dead engine's blocks is refused, saying why.
        try:
            st = _pull(decode, first["ticket"], [30, 31, 32])
            assert st.state == scheduler_pb2.TRANSFER_STATE_FAILED
            assert st.error.kind == common_pb2.ERROR_KIND_ENGINE_DETACHED, st.error
            text = f"{st.error.message} {st.error.fix}"
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            text = exc.details() or ""
        assert "attach" in text and "no KV pool" in text, text
        # A restarted engine attaches again and is pulled from.
        eng = Engine(att.engine_socket, "--request", "reborn", "--seed", "9")
        second = eng.line()
        assert second["generation"] > pool.registration_generation
        _pull_and_verify(att, decode, second["ticket"], [40, 41, 42, 43])
        eng.detach()
    finally:
        eng.kill()
    assert att.alive()  # type: ignore[operator]


@pytest.mark.slow
def test_staged_pulls_follow_each_attached_pool(tmp_path: Path) -> None:
    """The staging ring outlives attachments: a STAGED pull from an attached pool gathers from
    that pool, and after a detach and a re-attach (new memory) from the new one."""
    staged = ("--set", "transfer.strategy=staged", "--set", "transfer.staging_chunk_bytes=4194304")
    ds = launch(
        tmp_path,
        DaemonOptions("att", PRESET, extra=("--set", "pool.mode=attached", *staged)),
        DaemonOptions("decode", PRESET, extra=staged),
    )
    try:
        att, decode = ds["att"], ds["decode"]
        for seed, local in ((11, [30, 7, 41, 2]), (12, [50, 9, 33, 18])):
            eng = Engine(att.engine_socket, "--seed", str(seed), "--request", f"staged-{seed}")
            try:
                out = eng.line()
                remote = out["ticket"]["remote_block_ids"][0]
                done = _pull(decode, out["ticket"], local)
                assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
                assert done.strategy == scheduler_pb2.TRANSFER_STRATEGY_STAGED, done.strategy_reason
                assert _digests(decode.grpc, local) == _digests(att.grpc, remote)
                eng.detach()
            finally:
                eng.kill()
    finally:
        ds.stop()


def test_both_engines_reattached_with_a_new_layout_are_pulled_from(tmp_path: Path) -> None:
    """Both daemons serve engines; both engines restart with another KV layout. The decode
    daemon's handshake with the prefill daemon was checked against its old pool, so its own
    re-attach makes the next pull handshake again (docs/attachment.md, Liveness and detach): the
    pull is planned against the new layouts on both sides and reads the new bytes."""
    attached = ("--set", "pool.mode=attached")
    ds = launch(
        tmp_path,
        DaemonOptions("att", PRESET, extra=attached),
        DaemonOptions("decode", PRESET, extra=attached),
    )
    try:
        att, decode = ds["att"], ds["decode"]
        layouts = ("dense:num_blocks=64", "dense:num_blocks=64,num_kv_heads=4")
        for i, layout in enumerate(layouts):
            owner = Engine(att.engine_socket, "--preset", layout, "--request", f"owner-{i}")
            reader = Engine(
                decode.engine_socket, "--preset", layout, "--request", f"reader-{i}",
                "--blocks", "60", "--seed", str(20 + i),
            )  # fmt: skip
            try:
                ticket = owner.line()["ticket"]
                reader.line()
                local = [30 + i, 7, 41, 2]
                _pull_and_verify(att, decode, ticket, local)
                owner.detach()
                reader.detach()
            finally:
                owner.kill()
                reader.kill()
    finally:
        ds.stop()


def test_calls_the_pools_state_does_not_allow_are_failed_precondition(
    pair: tuple[Daemon, Daemon],
) -> None:
    """engine.proto: a Session for a stale or unknown attachment ID, and a Detach without
    force while requests are held (or of an owned pool), fail with FAILED_PRECONDITION: well
    formed calls, refused for the state they meet, each saying what to change."""
    att, owned = pair

    def refused(call: Any) -> common_pb2.ErrorDetail:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        detail = detail_from_rpc(err.value)
        assert detail is not None and detail.kind == common_pb2.ERROR_KIND_STATE_CONFLICT
        assert detail.fix
        return detail

    stub = _engine_stub(att)
    refused(lambda: list(stub.Session(engine_pb2.SessionRequest(attachment_id="no-such"))))
    refused(lambda: _engine_stub(owned).Detach(engine_pb2.DetachRequest()))
    eng = Engine(att.engine_socket, "--request", "held-at-detach")
    try:
        eng.line()  # attached, and the request held
        assert refused(lambda: stub.Detach(engine_pb2.DetachRequest())).field == "force"
        assert stub.Describe(engine_pb2.DescribeRequest()).pool.state  # still attached
    finally:
        eng.detach()


def test_the_engine_client_raises_the_class_the_daemon_sent(pair: tuple[Daemon, Daemon]) -> None:
    """kvxferd.engine: a refusal comes back as the daemon's own error class (its trailer),
    with its field and fix, not a class guessed from the status code (FAILED_PRECONDITION
    alone would read as LeaseRefused)."""
    att, _ = pair
    with EngineClient(att.engine_socket) as client:
        attachment = client.attach(PRESET)
        attachment.hold("held-for-client", [[1, 2]])
        with pytest.raises(StateConflict) as err:
            attachment.detach(force=False)
        assert err.value.field == "force" and err.value.fix
        assert attachment.detach() == 1  # with force: the held request released
