"""CMA through real daemons over their lives: an owner restarted on the same address is read
as its new process (the old pid dropped with its link), a large pull cancelled mid-copy ends
CANCELLED with every block invalid, and an owner whose memory the reader may not read (a real
EPERM from the kernel: another user, no CAP_SYS_PTRACE) is read DIRECT with the reason."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvxferd.scenario.daemons import READY_TIMEOUT_S, DaemonOptions, DaemonSet
from kvxferd.scenario.daemons import Daemon as Proc
from kvxferd.scenario.ports import free_port
from kvxferd.v1 import scheduler_pb2
from tests.ipc.test_cma_daemons import CMA, DIRECT, DONE, Client, run
from tests.service.conftest import Daemon, launch

SPEC = "dense:num_blocks=64"
CANCELLED = scheduler_pb2.TRANSFER_STATE_CANCELLED
TRANSFERRING = scheduler_pb2.TRANSFER_STATE_TRANSFERRING


def view(ds: DaemonSet, name: str) -> Daemon:
    d = ds[name]
    assert d.ready is not None
    return Daemon(d.ready.grpc, d.ready.engine_socket, d.ready.metrics, d.alive, d.log_path)


def owner_pids(log: Path) -> list[int]:
    """The owner pid each "handshake done" line of a reader's log names."""
    out = []
    for line in log.read_text().splitlines():
        if '"handshake done"' in line:
            pid = json.loads(line).get("owner_pid")
            out.append(int(pid) if pid is not None else 0)
    return out


@pytest.mark.slow
def test_a_restarted_owner_is_read_as_its_new_process(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "d").mkdir()
    decode = launch(tmp_path / "d", DaemonOptions("decode", SPEC))

    def prefill(workdir: Path, seed: int) -> DaemonSet:
        workdir.mkdir(parents=True, exist_ok=True)
        opts = DaemonOptions(
            "prefill", SPEC, fill_seed=seed, extra=("--listen", f"127.0.0.1:{port}")
        )
        ds = DaemonSet(workdir, [opts])
        ds.start()
        ds.wait_ready()
        return ds

    async def pulls(owner: Daemon, tag: str, n: int) -> list[scheduler_pb2.TransferStatus]:
        c = Client(owner, decode["decode"])
        out = []
        for i in range(n):
            remote, local = [[1 + i, 9, 30]], [[3 + i, 40, 50]]
            st = await c.pull(f"{tag}-{i}", remote, local)
            assert st.state == DONE, st.error.message
            assert await c.same(remote, local)  # the new process's bytes (another seed)
            out.append(st)
        return out

    first = prefill(tmp_path / "p1", seed=31)
    second: DaemonSet | None = None
    try:
        old_pid = first["prefill"].ready.pid  # type: ignore[union-attr]
        before: list[scheduler_pb2.TransferStatus] = []
        run(_collect(pulls(view(first, "prefill"), "before", 1), before))
        assert before[0].strategy == CMA and before[0].strategy_reason.endswith(
            f"process {old_pid}"
        )
        os.kill(old_pid, signal.SIGKILL)
        first["prefill"].proc.wait(10)  # type: ignore[union-attr]
        second = prefill(tmp_path / "p2", seed=32)
        new_pid = second["prefill"].ready.pid  # type: ignore[union-attr]
        after: list[scheduler_pb2.TransferStatus] = []
        run(_collect(pulls(view(second, "prefill"), "after", 3), after))
        cma = [st for st in after if st.strategy == CMA]
        assert cma, [st.strategy_reason for st in after]
        assert all(st.strategy_reason.endswith(f"process {new_pid}") for st in cma)
        assert owner_pids(decode["decode"].log)[-1] == new_pid
        assert old_pid in owner_pids(decode["decode"].log)
    finally:
        first.stop()
        if second is not None:
            second.stop()
        decode.stop()


async def _collect(coro: object, into: list[scheduler_pb2.TransferStatus]) -> None:
    into.extend(await coro)  # type: ignore[misc]


BIG = "dense:num_blocks=520"


@pytest.mark.slow
def test_a_large_pull_cancelled_mid_copy_ends_cancelled_with_every_block_invalid(
    tmp_path: Path,
) -> None:
    """1 GiB (512 blocks of 2 MiB) copied by one thread: the cancel lands between calls."""
    ds = launch(
        tmp_path,
        DaemonOptions("prefill", BIG, fill_seed=3),
        DaemonOptions("decode", BIG, extra=("--set", "transfer.cma_threads=1")),
    )
    try:

        async def attempt(i: int) -> scheduler_pb2.TransferStatus | None:
            c = Client(ds["prefill"], ds["decode"])
            ids = list(range(512))
            tid = await c.start(f"big-{i}", [ids], [ids[::-1]])
            stream = c.reader.WatchTransfers(
                scheduler_pb2.WatchTransfersRequest(transfer_ids=[tid])
            )
            async for msg in stream:
                if msg.status.state == TRANSFERRING:
                    break
            stream.cancel()
            await c.reader.CancelTransfer(scheduler_pb2.CancelTransferRequest(transfer_id=tid))
            st = await c.wait(tid)
            if st.state == DONE:
                return None  # the copy won the race: try again
            return st

        async def go() -> None:
            for i in range(4):
                st = await attempt(i)
                if st is None:
                    continue
                assert st.state == CANCELLED, st.error.message
                assert st.strategy == CMA
                assert "during its CMA copy" in st.error.message
                invalid = sorted(st.invalid_local_block_ids.groups[0].ids)
                assert invalid == list(range(512))
                return
            pytest.fail("every copy finished before its cancel landed")

        run(go())
    finally:
        ds.stop()


class Unshared(Proc):
    """A daemon started in a PID namespace of its own (``unshare --pid --fork``): processes
    outside it, the owner's included, are not visible there (SO_PEERCRED gives pid 0)."""

    def command(self) -> list[str]:
        cmd = super().command()
        at = cmd.index("-m")  # python -c WRAPPER PARENT python -m kvxferd serve ...
        unshare = shutil.which("unshare") or "unshare"
        return [*cmd[: at - 1], unshare, "--pid", "--fork", "--kill-child=SIGTERM", *cmd[at - 1 :]]


def _can_unshare_pid() -> bool:
    tool = shutil.which("unshare")
    if tool is None:
        return False
    done = subprocess.run([tool, "--pid", "--fork", "true"], capture_output=True, check=False)
    return done.returncode == 0


@pytest.mark.skipif(not _can_unshare_pid(), reason="needs unshare --pid (root or user namespaces)")
def test_an_owner_in_a_pid_namespace_the_reader_cannot_see_is_read_direct_with_the_reason(
    tmp_path: Path,
) -> None:
    (tmp_path / "o").mkdir()
    owners = launch(tmp_path / "o", DaemonOptions("prefill", SPEC, fill_seed=8))
    (tmp_path / "r").mkdir()
    reader = Unshared(DaemonOptions("decode", SPEC), tmp_path / "r")
    try:
        reader.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while reader.poll_ready() is None:
            assert reader.alive(), reader.tail()
            assert time.monotonic() < deadline, reader.tail()
            time.sleep(0.05)
        ready = reader.ready
        assert ready is not None
        me = Daemon(ready.grpc, ready.engine_socket, ready.metrics, reader.alive, reader.log_path)

        async def go() -> None:
            c = Client(owners["prefill"], me)
            remote, local = [[4, 5, 6]], [[7, 8, 9]]
            st = await c.pull("hidden", remote, local)
            assert st.state == DONE, st.error.message
            assert st.strategy == DIRECT, st.strategy_reason
            assert "CMA not possible" in st.strategy_reason
            assert "not visible in this daemon's PID namespace" in st.strategy_reason
            assert await c.same(remote, local)

        run(go())
    finally:
        if reader.proc is not None:
            reader.proc.terminate()
            try:
                reader.proc.wait(20)
            except subprocess.TimeoutExpired:
                reader.proc.kill()
                reader.proc.wait()
        owners.stop()
