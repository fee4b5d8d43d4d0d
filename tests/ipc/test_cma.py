"""CMA pieces in one process (the owner's memory is this process's own, read for real with
process_vm_readv): the pure eligibility and choice, the range checks that refuse before any
system call, the copy with partial reads, cancel and deadline between calls, the probe's real
failures (ESRCH, EFAULT) and how errors are explained, SO_PEERCRED on the same-host socket."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvxferd.blocks.ranges import RegionRanges, TransferPlan
from kvxferd.errors import BlockRangeError, InvalidRequest
from kvxferd.ipc.cma import IOV_MAX, OwnerProcess, explain, probe, process_vm_readv
from kvxferd.ipc.cma_eligibility import OwnerFacts, cma_ineligible
from kvxferd.ipc.cma_reader import CmaJob, CmaReader, build_iovecs
from kvxferd.layout.spec import MemoryType
from kvxferd.staging.strategy import CostModel, Mode, Strategy, choose
from kvxferd.transfer.descriptors import RegionTable
from kvxferd.transfer.state import TransferStatus
from kvxferd.wire.local import LocalTransport, peer_credentials

BLOCK = 64 << 10
DRAM, VRAM = MemoryType.DRAM, MemoryType.VRAM
OK_FACTS = OwnerFacts(pid=123, same_channel=True, same_incarnation=True)


# -- eligibility and choice (pure) ---------------------------------------------------------------


def _why(**kw: object) -> str | None:
    args: dict[str, object] = {
        "enabled": True,
        "local_memory": DRAM,
        "remote_memory": DRAM,
        "owner": OK_FACTS,
        "peer": "p:1",
    }
    args.update(kw)
    return cma_ineligible(**args)  # type: ignore[arg-type]


def test_cma_is_eligible_only_with_every_condition_met() -> None:
    assert _why() is None
    assert _why(enabled=False) == "this daemon's transfer.cma = false"
    assert "this daemon's pool is in GPU memory" in str(_why(local_memory=VRAM))
    assert "peer p:1's pool is in GPU memory" in str(_why(remote_memory=VRAM))
    assert "not reached over its same-host Peer socket" in str(_why(owner=None))
    hidden = str(_why(owner=OwnerFacts(0, True, True)))
    assert "PID namespace" in hidden and "pid 0" in hidden and "shareProcessNamespace" in hidden
    assert "restarted" in str(_why(owner=OwnerFacts(5, True, False)))
    assert "reconnected" in str(_why(owner=OwnerFacts(5, False, True)))
    assert "invalidated" in str(_why(owner=OwnerFacts(5, True, True, dropped="invalidated")))
    assert "has exited" in str(_why(owner=OwnerFacts(5, True, True, exited=True)))
    failed = _why(owner=OwnerFacts(5, True, True, probe_failure="EPERM, fix: same user"))
    assert failed == "reading peer p:1's memory failed: EPERM, fix: same user"


def test_the_feature_switch_is_checked_before_anything_about_the_peer() -> None:
    assert (
        _why(enabled=False, owner=None, remote_memory=VRAM) == "this daemon's transfer.cma = false"
    )


MODEL = CostModel.defaults(DRAM)
KW = {"descriptors": 16384, "nbytes": 1 << 30, "chunks": 16, "ineligible": "no ring"}


def test_auto_and_kernel_pick_cma_whenever_it_can_run() -> None:
    for mode in (Mode.AUTO, Mode.KERNEL):
        c = choose(mode, MODEL, kernel_ineligible="DRAM", cma_ineligible=None, **KW)  # type: ignore[arg-type]
        assert c.strategy is Strategy.CMA
        assert "process_vm_readv" in c.reason and c.cma_s < c.direct_s
    assert (
        "forced by transfer.strategy = kernel"
        in choose(
            Mode.KERNEL,
            MODEL,
            kernel_ineligible="DRAM",
            cma_ineligible=None,
            **KW,  # type: ignore[arg-type]
        ).reason
    )


def test_direct_and_staged_never_pick_cma() -> None:
    kw = {**KW, "ineligible": None}
    d = choose(Mode.DIRECT, MODEL, kernel_ineligible="DRAM", cma_ineligible=None, **kw)  # type: ignore[arg-type]
    s = choose(Mode.STAGED, MODEL, kernel_ineligible="DRAM", cma_ineligible=None, **kw)  # type: ignore[arg-type]
    assert (d.strategy, s.strategy) == (Strategy.DIRECT, Strategy.STAGED)
    assert d.reason == "forced by transfer.strategy = direct"


def test_a_pull_that_cannot_be_cma_says_why_and_falls_back() -> None:
    c = choose(
        Mode.AUTO, MODEL, kernel_ineligible="DRAM", cma_ineligible="transfer.cma = false", **KW
    )  # type: ignore[arg-type]
    assert c.strategy is Strategy.DIRECT
    assert c.reason.startswith("CMA not possible: transfer.cma = false; STAGED not possible")
    k = choose(Mode.KERNEL, MODEL, kernel_ineligible="DRAM", cma_ineligible="probe failed", **KW)  # type: ignore[arg-type]
    assert k.strategy is Strategy.DIRECT
    assert k.reason.startswith("forced kernel, but CMA not possible: probe failed; as auto:")
    gpu = choose(Mode.AUTO, MODEL, kernel_ineligible="other host", **KW)  # type: ignore[arg-type]
    assert "CMA" not in gpu.reason  # "not considered" (GPU pools): no CMA noise


# -- the copy, in this process ------------------------------------------------------------------


class Pools:
    """A source (the "owner") and a destination buffer, and a random-block plan between them."""

    def __init__(self, blocks: int = 256, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.src = rng.integers(0, 255, size=blocks * BLOCK, dtype=np.uint8)
        self.dst = np.zeros(blocks * BLOCK, dtype=np.uint8)
        self.ro = rng.permutation(blocks).astype(np.int64) * BLOCK
        self.lo = rng.permutation(blocks).astype(np.int64) * BLOCK
        self.plan = TransferPlan(
            (RegionRanges(0, "kv", self.lo, self.ro, np.full(blocks, BLOCK, np.int64)),),
            local_kernel_blocks=(np.arange(blocks, dtype=np.int64),),
        )
        self.local_rows = np.array([[self.dst.ctypes.data, self.dst.nbytes, 0]], np.int64)
        self.remote_rows = np.array([[self.src.ctypes.data, self.src.nbytes, 0]], np.int64)

    def job(self, deadline_s: float = 60.0, owner: OwnerProcess | None = None) -> CmaJob:
        me = owner or OwnerProcess(os.getpid(), os.getuid(), ("a", "i", 1), 1, None)
        return CmaJob("t1", "agent", "peer:1", me, self.remote_rows, time.monotonic() + deadline_s)

    def same(self) -> bool:
        got = self.dst.reshape(-1, BLOCK)[self.lo // BLOCK]
        want = self.src.reshape(-1, BLOCK)[self.ro // BLOCK]
        return bool(np.array_equal(got, want))


def _pull(reader: CmaReader, pools: Pools, **kw: object) -> object:
    async def go() -> object:
        return await reader.pull(pools.job(**kw), pools.plan, pools.plan.local_kernel_blocks)  # type: ignore[arg-type]

    return asyncio.run(go())


class Counting:
    """The real system call, counted (and optionally limited to ``cap`` bytes per call: a
    genuine partial read, the kernel asked for fewer bytes than the batch holds)."""

    def __init__(self, cap: int = 0, gate: threading.Event | None = None) -> None:
        self.calls = 0
        self.cap = cap
        self.gate = gate
        self.started = threading.Event()

    def __call__(self, pid: int, local: int, remote: int, count: int) -> int:
        self.calls += 1
        self.started.set()
        if self.gate is not None:
            self.gate.wait(10)
        if not self.cap:
            return process_vm_readv(pid, local, remote, count)
        li = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * count)).from_address(local)).copy()
        ri = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * count)).from_address(remote)).copy()
        left, n = self.cap, 0
        while n < count and left > 0:  # truncate the iovecs to cap bytes (may split one)
            take = min(int(li[2 * n + 1]), left)
            li[2 * n + 1] = ri[2 * n + 1] = take
            left -= take
            n += 1
        return process_vm_readv(pid, li.ctypes.data, ri.ctypes.data, n)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_cma_pull_copies_exactly_the_planned_blocks(threads: int) -> None:
    pools = Pools(blocks=2048)
    r = CmaReader(pools.local_rows, threads=threads)
    try:
        res = _pull(r, pools)
    finally:
        r.close()
    assert res.status is TransferStatus.DONE, res.reason  # type: ignore[attr-defined]
    assert res.invalid_blocks == () and res.descriptors == 2048  # type: ignore[attr-defined]
    assert pools.same()
    assert r.last.calls >= 2  # 2048 ranges: at least two calls of 1024
    assert r.last.workers == min(threads, r.last.batches)


def test_a_small_pull_is_one_call_on_a_worker() -> None:
    pools = Pools(blocks=8)
    r = CmaReader(pools.local_rows, threads=2)
    res = _pull(r, pools)
    r.close()
    assert res.status is TransferStatus.DONE and pools.same()  # type: ignore[attr-defined]
    assert r.last.calls == 1 and r.last.workers == 1


def test_a_call_that_blocks_never_blocks_the_event_loop() -> None:
    # process_vm_readv can block on the owner's memory-map lock for as long as another process
    # holds it (a fault we cannot cause on demand, hence the gate). The loop must keep running
    # (heartbeats, RPCs) meanwhile, and the pull must not end before the call returns.
    pools = Pools(blocks=1)  # one 64 KiB block: the smallest pull
    gate = threading.Event()
    readv = Counting(gate=gate)
    r = CmaReader(pools.local_rows, threads=1, readv=readv)

    async def go() -> tuple[object, int, bool]:
        task = asyncio.ensure_future(
            r.pull(pools.job(deadline_s=0.05), pools.plan, pools.plan.local_kernel_blocks)
        )
        ticks = 0
        while not readv.started.is_set():
            await asyncio.sleep(0.001)
        t_end = time.monotonic() + 0.2  # past the pull's deadline, the call still blocked
        while time.monotonic() < t_end:
            await asyncio.sleep(0.005)
            ticks += 1
        ended_early = task.done()
        gate.set()
        return await task, ticks, ended_early

    res, ticks, ended_early = asyncio.run(go())
    r.close()
    assert ticks >= 10  # the loop ran on while the call was blocked
    assert not ended_early  # the bytes could still land: the pull waited for the call
    assert res.status is TransferStatus.EXPIRED  # type: ignore[attr-defined]
    assert res.invalid_blocks == pools.plan.local_kernel_blocks  # type: ignore[attr-defined]


@pytest.mark.parametrize("cap", [BLOCK, BLOCK // 2 + 123, 3 * BLOCK + 7])
def test_partial_reads_continue_where_they_stopped(cap: int) -> None:
    pools = Pools(blocks=64)
    readv = Counting(cap=cap)
    r = CmaReader(pools.local_rows, threads=2, readv=readv)
    res = _pull(r, pools)
    r.close()
    assert res.status is TransferStatus.DONE, res.reason  # type: ignore[attr-defined]
    assert pools.same()
    assert readv.calls >= 64 * BLOCK // cap


def test_batches_hold_at_most_iov_max_ranges_and_cover_every_byte() -> None:
    pools = Pools(blocks=3000)
    iov = build_iovecs(
        pools.plan,
        RegionTable.from_array(pools.local_rows),
        RegionTable.from_array(pools.remote_rows),
        threads=2,
    )
    assert all(0 < b - a <= IOV_MAX for a, b in iov.batches)
    assert [a for a, _ in iov.batches][1:] == [b for _, b in iov.batches][:-1]
    assert int(iov.local[:, 1].sum()) == int(iov.remote[:, 1].sum()) == 3000 * BLOCK


def test_a_long_contiguous_run_is_cut_so_that_workers_share_it() -> None:
    pools = Pools(blocks=1024)
    n = 1024 * BLOCK
    plan = TransferPlan(
        (RegionRanges(0, "kv", np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([n])),)
    )
    iov = build_iovecs(
        plan,
        RegionTable.from_array(pools.local_rows),
        RegionTable.from_array(pools.remote_rows),
        threads=2,
    )
    assert iov.runs == 1 and len(iov.batches) >= 4


def test_a_remote_range_outside_the_owners_regions_is_refused_before_any_call() -> None:
    pools = Pools(blocks=16)
    plan = TransferPlan(
        (RegionRanges(0, "kv", np.array([0]), np.array([15 * BLOCK + 1]), np.array([BLOCK])),)
    )
    with pytest.raises(BlockRangeError, match="remote ranges of region 0 leave the region"):
        build_iovecs(
            plan,
            RegionTable.from_array(pools.local_rows),
            RegionTable.from_array(pools.remote_rows),
        )
    readv = Counting()
    r = CmaReader(pools.local_rows, readv=readv)

    async def go() -> object:
        return await r.pull(pools.job(), plan, (np.array([0]),))

    res = asyncio.run(go())
    r.close()
    assert res.status is TransferStatus.FAILED and readv.calls == 0  # type: ignore[attr-defined]
    assert "leave the region" in res.reason  # type: ignore[attr-defined]


def test_a_local_range_outside_this_daemons_regions_or_an_unknown_region_is_refused() -> None:
    pools = Pools(blocks=16)
    local, remote = (
        RegionTable.from_array(pools.local_rows),
        RegionTable.from_array(pools.remote_rows),
    )
    beyond = TransferPlan(
        (RegionRanges(0, "kv", np.array([16 * BLOCK]), np.array([0]), np.array([1])),)
    )
    with pytest.raises(BlockRangeError, match="local ranges of region 0"):
        build_iovecs(beyond, local, remote)
    other = TransferPlan((RegionRanges(1, "v", np.array([0]), np.array([0]), np.array([1])),))
    with pytest.raises(InvalidRequest, match="plan names region 1"):
        build_iovecs(other, local, remote)


def test_a_cancel_between_calls_ends_cancelled_with_every_block_invalid() -> None:
    pools = Pools(blocks=4096)
    gate = threading.Event()
    readv = Counting(gate=gate)
    r = CmaReader(pools.local_rows, threads=1, readv=readv)

    async def go() -> object:
        task = asyncio.ensure_future(
            r.pull(pools.job(), pools.plan, pools.plan.local_kernel_blocks)
        )
        while not readv.started.is_set():
            await asyncio.sleep(0.001)
        assert r.cancel("t1") and not r.cancel("other")
        gate.set()
        return await task

    res = asyncio.run(go())
    r.close()
    assert res.status is TransferStatus.CANCELLED  # type: ignore[attr-defined]
    assert "cancelled by a caller during its CMA copy" in res.reason  # type: ignore[attr-defined]
    assert res.invalid_blocks == pools.plan.local_kernel_blocks  # type: ignore[attr-defined]
    assert readv.calls < r.last.batches  # it stopped early
    assert not r.cancel("t1")  # no longer running


def test_a_copy_past_its_deadline_is_expired_with_every_block_invalid() -> None:
    pools = Pools(blocks=2048)
    gate = threading.Event()
    readv = Counting(gate=gate)
    r = CmaReader(pools.local_rows, threads=1, readv=readv)
    threading.Timer(0.3, gate.set).start()
    res = _pull(r, pools, deadline_s=0.1)
    r.close()
    assert res.status is TransferStatus.EXPIRED  # type: ignore[attr-defined]
    assert "deadline" in res.reason  # type: ignore[attr-defined]
    assert res.invalid_blocks == pools.plan.local_kernel_blocks  # type: ignore[attr-defined]


def test_a_failing_call_names_the_cause_and_the_fix() -> None:
    pools = Pools(blocks=4)

    def refused(pid: int, local: int, remote: int, count: int) -> int:
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))  # a fault only root can't cause

    r = CmaReader(pools.local_rows, readv=refused)
    res = _pull(r, pools)
    r.close()
    assert res.status is TransferStatus.FAILED  # type: ignore[attr-defined]
    assert "EPERM" in res.reason and "ptrace_scope" in res.reason  # type: ignore[attr-defined]


def test_a_dropped_owner_is_never_read() -> None:
    pools = Pools(blocks=4)
    owner = OwnerProcess.open(
        os.getpid(), 0, ("a", "i", 1), connection=1, channel=None, transport=None
    )
    owner.drop("peer invalidated")
    readv = Counting()
    r = CmaReader(pools.local_rows, readv=readv)
    res = _pull(r, pools, owner=owner)
    r.close()
    assert res.status is TransferStatus.FAILED and readv.calls == 0  # type: ignore[attr-defined]
    assert "no longer vouched for: peer invalidated" in res.reason  # type: ignore[attr-defined]


# -- the probe and the owner's process -----------------------------------------------------------


def test_probe_reads_a_live_process() -> None:
    buf = np.arange(100, dtype=np.uint8)
    assert probe(os.getpid(), buf.ctypes.data, buf.nbytes) is None


def test_probe_of_an_exited_process_says_esrch() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    why = probe(child.pid, 0x10000, 4096)
    assert why is not None and "ESRCH" in why and "exited or restarted" in why


def test_probe_of_an_unmapped_address_says_efault() -> None:
    why = probe(os.getpid(), 0x1000, 4096)  # the first pages are never mapped
    assert why is not None and "EFAULT" in why and "not mapped" in why


def test_probe_of_pid_zero_says_not_visible() -> None:
    assert "not visible" in str(probe(0, 0x10000, 4096))


def test_explain_gives_the_fix_for_each_errno() -> None:
    for code, word in [
        (errno.EPERM, "CAP_SYS_PTRACE"),
        (errno.ENOSYS, "seccomp"),
        (errno.ENOMEM, "transfer.cma = false"),
    ]:
        what, fix = explain(OSError(code, os.strerror(code)), 42)
        assert word in fix and what


def test_the_owner_process_sees_its_process_exit() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        owner = OwnerProcess.open(
            child.pid, 0, ("a", "i", 1), connection=1, channel=None, transport=None
        )
        assert owner.pidfd >= 0 and not owner.exited()
    finally:
        child.kill()
        child.wait()
    assert owner.exited()
    with owner.use():
        owner.drop("gone")
        assert owner.pidfd >= 0  # held while a copy uses it
    assert owner.pidfd == -1


def test_the_probe_runs_once_per_verified_connection() -> None:
    buf = np.arange(64, dtype=np.uint8)
    calls: list[int] = []

    def readv(pid: int, local: int, remote: int, count: int) -> int:
        calls.append(pid)
        return process_vm_readv(pid, local, remote, count)

    owner = OwnerProcess.open(
        os.getpid(), 0, ("a", "i", 1), connection=1, channel=None, transport=None
    )
    for _ in range(3):
        assert owner.ensure_probed(buf.ctypes.data, buf.nbytes, readv) is None
    assert calls == [os.getpid()]


def test_so_peercred_names_the_process_at_the_other_end(tmp_path: Path) -> None:
    """The credentials the kernel recorded for the other end of a connected Unix socket (the
    daemon tests check the whole path: the pull's reason names the owner daemon's pid)."""
    path = str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX) as server, socket.socket(socket.AF_UNIX) as client:
        server.bind(path)
        server.listen(1)
        client.connect(path)
        conn, _ = server.accept()
        with conn:
            assert peer_credentials(client)[:2] == (os.getpid(), os.getuid())
            assert peer_credentials(conn)[0] == os.getpid()
    t = LocalTransport(path)
    assert t.peer is None and not t.current(0)  # no connection yet: no process named


def test_a_pull_after_the_pool_went_away_ends_cancelled_without_a_call() -> None:
    # A pull that chose CMA before its engine detached may reach the reader after close():
    # nothing is read, and the pull says why (the closed worker pool takes no work).
    pools = Pools(blocks=4)
    readv = Counting()
    r = CmaReader(pools.local_rows, readv=readv)
    r.close()
    res = _pull(r, pools)
    assert res.status is TransferStatus.CANCELLED, res.reason  # type: ignore[attr-defined]
    assert "pool went away before the CMA copy began" in res.reason  # type: ignore[attr-defined]
    assert readv.calls == 0
