"""The owner (prefill) side across its engine's detach and re-attach, with a reader's READ in
flight (real daemons, real engine processes, SIGSTOP of the reader to stall it for real).

A reader confirmed its share of a held request and is reading the owner's pool when the owner's
engine detaches and a new engine attaches. The share the owner granted promised the blocks until
its expiry (``remaining_ms``); a reader trusts a READ that completes before it (and before a
heartbeat reports the share lost). So the owner must not let the detached pool's memory be
replaced by the next engine's while such a share may still be read: a pull that ends DONE must
hold the bytes of the request it confirmed, never the re-attached engine's."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from kvxferd.wire.codec import group_ids_to_proto
from tests.attach.test_attach import TERMINAL, Engine
from tests.service.conftest import Daemon, Daemons, launch

BLOCKS = 96  # dense: 2 MiB per block, 192 MiB per pool
PRESET = f"dense:num_blocks={BLOCKS}"
# The reader heartbeats every 50 s; shares last at most 60 s (the owner's heartbeat timeout).
HEARTBEATS = (
    *("--set", "peers.heartbeat_interval_ms=50000"),
    *("--set", "peers.heartbeat_timeout_ms=60000"),
)


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    ds = launch(
        tmp_path_factory.mktemp("reattach-under-read"),
        DaemonOptions("att", PRESET, extra=("--set", "pool.mode=attached", *HEARTBEATS)),
        DaemonOptions("decode", PRESET, extra=(*HEARTBEATS, "--set", "transfer.cma_threads=1")),
    )
    yield ds
    ds.stop()


def _sched(d: Daemon) -> scheduler_pb2_grpc.SchedulerStub:
    return scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(d.grpc))


def _digests(d: Daemon, ids: list[int]) -> list[bytes]:
    resp = _sched(d).Checksum(
        scheduler_pb2.ChecksumRequest(group_index=0, block_ids=ids, kernel_block_ids=True)
    )
    return list(resp.digests)


def _status(d: Daemon, tid: str) -> scheduler_pb2.TransferStatus:
    return _sched(d).GetTransfer(scheduler_pb2.GetTransferRequest(transfer_id=tid)).status


def _shm_maps(pid: int) -> list[str]:
    """The daemon's mappings of its shared-memory segments, as "start-end name"."""
    with open(f"/proc/{pid}/maps") as f:
        return [
            f"{p[0]} {p[-1].rsplit('/', 1)[-1]}"
            for line in f
            if "/dev/shm/kvxferd-" in line and (p := line.split())
        ]


def _generation(d: Daemon) -> int:
    stub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(f"unix:{d.engine_socket}"))
    return int(stub.Describe(engine_pb2.DescribeRequest()).pool.registration_generation)


def test_a_read_in_flight_across_a_reattach_never_ends_done_with_the_new_engines_bytes(
    daemons: Daemons,
) -> None:
    att, decode = daemons["att"], daemons["decode"]
    reader = daemons.set["decode"].proc
    assert reader is not None
    ids = list(range(BLOCKS))
    local = ids[::-1]
    first = Engine(att.engine_socket, "--preset", PRESET, "--seed", "7", "--request", "old",
                   "--blocks", ",".join(map(str, ids)))  # fmt: skip
    second: Engine | None = None
    stopped = False
    try:
        ticket = first.line()["ticket"]
        old = _digests(att, ids)
        owner = daemons.set["att"].proc
        assert owner is not None
        maps_before = _shm_maps(owner.pid)
        st = (
            _sched(decode)
            .StartPull(
                scheduler_pb2.StartPullRequest(
                    request_id=ticket["request_id"],
                    peer_address=ticket["peer_address"],
                    remote_block_ids=group_ids_to_proto(ticket["remote_block_ids"]),
                    local_block_ids=group_ids_to_proto([local]),
                    deadline_ms=60_000,
                )
            )
            .status
        )
        tid = st.transfer_id
        end = time.monotonic() + 20
        while (s := _status(decode, tid)).state != scheduler_pb2.TRANSFER_STATE_TRANSFERRING:
            assert s.state not in TERMINAL, f"the pull ended before it could be stalled: {s}"
            assert time.monotonic() < end, s
        os.kill(reader.pid, signal.SIGSTOP)  # the reader stalls mid-READ (a loaded machine)
        stopped = True
        gen = _generation(att)
        first.detach()  # the owner's engine goes away while the share is being read...
        second = Engine(att.engine_socket, "--preset", PRESET, "--seed", "8", "--request", "new")
        second.line()  # ...and a new engine attaches a pool of the same size
        assert _generation(att) > gen
        new = _digests(att, ids)
        maps_after = _shm_maps(owner.pid)
        assert new != old
        os.kill(reader.pid, signal.SIGCONT)
        stopped = False
        end = time.monotonic() + 20
        while (s := _status(decode, tid)).state not in TERMINAL:
            assert time.monotonic() < end, s
            time.sleep(0.005)
    finally:
        if stopped:
            os.kill(reader.pid, signal.SIGCONT)
        first.kill()
        if second is not None:
            second.kill()
    got = _digests(decode, local)
    from_new = [i for i, (g, n) in enumerate(zip(got, new, strict=True)) if g == n]
    from_old = [i for i, (g, o) in enumerate(zip(got, old, strict=True)) if g == o]
    reused = {m.split()[0] for m in maps_after} & {m.split()[0] for m in maps_before}
    if s.state == scheduler_pb2.TRANSFER_STATE_DONE:
        assert got == old, (
            f"the pull ended DONE, yet only {len(from_old)} of {BLOCKS} blocks hold the bytes of"
            f" the request it confirmed ({len(from_new)} the re-attached engine's, the rest a"
            " mix): the owner let the next engine's pool replace the detached one while the"
            f" reader's share of it was valid ({len(reused)} of the re-attached pool's"
            f" {len(maps_after)} segments are mapped where the detached pool's were)"
        )
    else:  # refused, failed or lapsed: every local block listed
        (listed,) = s.invalid_local_block_ids.groups
        assert sorted(listed.ids) == sorted(local), s
