"""Engine attachment study (issue 7): how an engine's KV memory reaches the daemon's NIXL agent.

Run from the repository root on a GPU machine::

    python -m bench.studies.attachment --reader-device 1 --json out.json     # two GPUs
    python -m bench.studies.attachment --reader-device 0 --json out.json     # one GPU
    UCX_RNDV_SCHEME=get_zcopy python -m bench.studies.attachment --modes ipc-import \
        --label ucx:get_zcopy

Three processes per mode, as in a deployment: the **engine** (computes into the KV cache; here
it fills the memory with random bytes), the **daemon** (its NIXL agent registers the memory
that holds the cache and serves it) and the **peer** (this process: the other side's daemon,
with its own memory, issuing READs from and WRITEs into the daemon's registered memory). The
engine and the daemon share a GPU (``--device``); the peer uses ``--reader-device``.

Modes (how the memory the daemon registers came to be):

* ``owned``: the daemon allocates (``torch.empty``) and registers; no engine. Baseline; it is
  also what the in-process mode (c) amounts to on the wire: the process that holds the agent
  allocated the memory.
* ``export``: (a) the daemon allocates and registers, then exports the memory to the engine over
  CUDA IPC (``torch.multiprocessing``); the engine writes into it.
* ``ipc-import``: the engine allocates and exports over CUDA IPC; the daemon imports and
  registers the imported pointer (the slow case of docs/nixl.md §6).
* ``vmm-owned``: the daemon allocates with CUDA VMM (``cuMemCreate``, POSIX-fd shareable).
* ``vmm-import``: (b) the engine allocates with ``cuMemCreate``, sends the fd over a Unix
  socket (SCM_RIGHTS), the daemon imports and maps the same physical memory and registers it.

Run ``ipc-import`` again under UCX settings for candidate (d). Request, the reference workload
of docs/nixl.md §5: 512 random blocks of 2 MiB (cross-layer rows: 32 layers x 64 KiB) = 1 GiB,
as 512 descriptors and, for the limit, as one contiguous 1 GiB descriptor; READ and WRITE.
Every row is verified: the peer's digest of its blocks equals the daemon's digest of the
registered memory, and for the engine modes the engine's own view as well (what the engine
computes into is what moved).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as tmp

NUM_BLOCKS = 2048
ROW = 32 * 2 * 16 * 8 * 128 * 2  # 2 MiB: one block, all 32 layers (cross-layer layout)
REQ = 512
POOL_BYTES = NUM_BLOCKS * ROW
REQ_BYTES = REQ * ROW
MODES = ("owned", "export", "ipc-import", "vmm-owned", "vmm-import")


def digest(pool: torch.Tensor, ids: np.ndarray) -> int:
    """Order-sensitive digest of rows ``ids`` of a (NUM_BLOCKS, ROW) byte view."""
    rows = pool.view(NUM_BLOCKS, ROW)
    idx = torch.from_numpy(ids).to(rows.device)
    w = torch.arange(1, len(ids) + 1, device=rows.device, dtype=torch.int64)
    sums = rows[idx].view(torch.int64).sum(dim=1)
    return int((sums * w).sum())


def _fill(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator(device=t.device)
    g.manual_seed(seed)
    t.view(torch.int64).random_(generator=g)


# -- engine process -------------------------------------------------------------------------


def _engine_main(conn: Connection, to_daemon: Connection, mode: str, dev: int) -> None:
    torch.cuda.set_device(dev)
    keep: list[Any] = []
    pool: torch.Tensor | None = None
    if mode == "ipc-import":
        pool = torch.empty(POOL_BYTES, dtype=torch.uint8, device=f"cuda:{dev}")
        _fill(pool, 11)
        torch.cuda.synchronize(dev)
        to_daemon.send(pool)  # CUDA IPC through torch.multiprocessing
    elif mode == "vmm-import":
        from multiprocessing.reduction import send_handle

        from bench.studies import cuda_vmm

        m = cuda_vmm.allocate(POOL_BYTES, dev)
        keep.append(m)
        pool = m.tensor(POOL_BYTES)
        _fill(pool, 11)
        torch.cuda.synchronize(dev)
        fd = m.export_fd()
        send_handle(to_daemon, fd, 0)  # SCM_RIGHTS over the Unix socket (pid: Windows only)
        os.close(fd)
    elif mode == "export":
        pool = to_daemon.recv()  # the daemon's allocation, mapped here over CUDA IPC
        _fill(pool, 11)
        torch.cuda.synchronize(dev)
    conn.send("ready")
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            break
        if cmd == "digest":
            assert pool is not None
            torch.cuda.synchronize(dev)
            conn.send(digest(pool, args[0]))
    del pool
    for m in keep:
        m.close()


# -- daemon process -------------------------------------------------------------------------


def _daemon_main(conn: Connection, from_engine: Connection, mode: str, dev: int) -> None:
    from kvxferd.nixl import MemType, NixlAgent

    torch.cuda.set_device(dev)
    keep: list[Any] = []
    t0 = time.perf_counter()
    if mode == "owned":
        pool = torch.empty(POOL_BYTES, dtype=torch.uint8, device=f"cuda:{dev}")
        _fill(pool, 11)
    elif mode == "export":
        pool = torch.zeros(POOL_BYTES, dtype=torch.uint8, device=f"cuda:{dev}")
        from_engine.send(pool)
    elif mode == "ipc-import":
        pool = from_engine.recv()
    elif mode == "vmm-owned":
        from bench.studies import cuda_vmm

        m = cuda_vmm.allocate(POOL_BYTES, dev)
        keep.append(m)
        pool = m.tensor(POOL_BYTES)
        _fill(pool, 11)
    elif mode == "vmm-import":
        from multiprocessing.reduction import recv_handle

        from bench.studies import cuda_vmm

        fd = recv_handle(from_engine)
        m = cuda_vmm.import_fd(fd, POOL_BYTES, dev)
        os.close(fd)
        keep.append(m)
        pool = m.tensor(POOL_BYTES)
    else:
        raise ValueError(mode)
    torch.cuda.synchronize(dev)
    attach_ms = (time.perf_counter() - t0) * 1e3
    agent = NixlAgent(f"attach-daemon-{os.getpid()}", cuda_device=dev)
    agent.start()
    rows = np.array([[pool.data_ptr(), POOL_BYTES, dev]], dtype=np.int64)
    t1 = time.perf_counter()
    agent.register(rows, MemType.VRAM)
    reg_ms = (time.perf_counter() - t1) * 1e3
    conn.send(("ready", agent.name, agent.metadata(), int(rows[0, 0]), attach_ms, reg_ms))
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            break
        if cmd == "add_remote":
            agent.add_remote(args[0], args[1])
            conn.send(None)
        elif cmd == "digest":
            torch.cuda.synchronize(dev)
            conn.send(digest(pool, args[0]))
    agent.close()
    del pool
    for m in keep:
        m.close()


class Proc:
    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = tmp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()

    def recv(self, timeout: float = 300) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("child did not answer")
        return self.conn.recv()

    def call(self, *msg: Any) -> Any:
        self.conn.send(msg)
        return self.recv()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(("stop",))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def _descs(base: int, ids: np.ndarray, dev: int) -> np.ndarray:
    out = np.empty((len(ids), 3), dtype=np.int64)
    out[:, 0] = base + ids * ROW
    out[:, 1] = ROW
    out[:, 2] = dev
    return out


def run_mode(mode: str, args: argparse.Namespace, label: str) -> list[dict[str, Any]]:
    dev = args.device
    ctx = tmp.get_context("spawn")
    eng_end, dmn_end = ctx.Pipe()
    engine = (
        Proc(_engine_main, eng_end, mode, dev)
        if mode in ("export", "ipc-import", "vmm-import")
        else None
    )
    daemon = Proc(_daemon_main, dmn_end, mode, dev)
    try:
        return _measure(mode, args, label, engine, daemon)
    finally:
        daemon.close()
        if engine is not None:
            engine.close()


def _measure(
    mode: str, args: argparse.Namespace, label: str, engine: Proc | None, daemon: Proc
) -> list[dict[str, Any]]:
    from kvxferd.nixl import MemType, NixlAgent, XferOp, XferState

    dev, rdev = args.device, args.reader_device
    msg = daemon.recv()
    _, name, meta, base, attach_ms, reg_ms = msg
    if engine is not None:
        engine.recv()

    torch.cuda.set_device(rdev)
    agent = NixlAgent(f"attach-peer-{os.getpid()}", cuda_device=rdev)
    agent.start()
    local = torch.empty(POOL_BYTES, dtype=torch.uint8, device=f"cuda:{rdev}")
    lrows = np.array([[local.data_ptr(), POOL_BYTES, rdev]], dtype=np.int64)
    agent.register(lrows, MemType.VRAM)
    agent.add_remote(name, meta)
    daemon.call("add_remote", agent.name, agent.metadata())
    rng = np.random.default_rng(args.seed)
    sids = rng.choice(NUM_BLOCKS, REQ, replace=False).astype(np.int64)
    dids = rng.choice(NUM_BLOCKS, REQ, replace=False).astype(np.int64)
    contiguous = np.arange(REQ, dtype=np.int64)
    out: list[dict[str, Any]] = []
    pair = f"{dev}->{rdev}" if dev != rdev else f"{dev} (same GPU)"

    def xfer(op: Any, loc: np.ndarray, rem: np.ndarray) -> None:
        h = agent.post(op, loc, rem, peer=name, local_mem=MemType.VRAM, remote_mem=MemType.VRAM)
        while agent.poll(h) is XferState.IN_PROGRESS:
            pass
        agent.release(h)

    def verify(op_name: str, src: np.ndarray, dst: np.ndarray) -> str:
        torch.cuda.synchronize(rdev)
        mine = digest(local, dst if op_name == "READ" else src)
        theirs_ids = src if op_name == "READ" else dst
        theirs = daemon.call("digest", theirs_ids)
        if mine != theirs:
            raise AssertionError(f"{mode} {op_name}: peer and daemon digests differ")
        if engine is not None and engine.call("digest", theirs_ids) != mine:
            raise AssertionError(
                f"{mode} {op_name}: the engine's view differs from the bytes moved"
            )
        return "ok" if engine is None else "ok (engine view too)"

    for op in (XferOp.READ, XferOp.WRITE):
        for scheme, rids, lids in (
            ("512 x 2 MiB random", sids, dids),
            ("1 x 1 GiB contiguous", contiguous, contiguous),
        ):
            if scheme.startswith("1 x"):
                loc = np.array([[int(lrows[0, 0]), REQ_BYTES, rdev]], dtype=np.int64)
                rem = np.array([[base, REQ_BYTES, dev]], dtype=np.int64)
            else:
                loc = _descs(int(lrows[0, 0]), lids, rdev)
                rem = _descs(base, rids, dev)
            if op is XferOp.WRITE:
                _fill(local, 1000 + len(out))
            else:
                local.zero_()
            torch.cuda.synchronize(rdev)
            t0 = time.perf_counter()
            xfer(op, loc, rem)  # warm: connection and IPC handle set-up
            warm_s = time.perf_counter() - t0
            checked = (
                verify(op.value, rids, lids) if op is XferOp.READ else verify(op.value, lids, rids)
            )
            repeat = args.repeat if warm_s < 1.0 else 1
            secs = []
            for _ in range(repeat):
                torch.cuda.synchronize(rdev)
                t0 = time.perf_counter()
                xfer(op, loc, rem)
                torch.cuda.synchronize(rdev)
                secs.append(time.perf_counter() - t0)
            gbps = REQ_BYTES / statistics.median(secs) / 1e9
            row = {
                "mode": mode,
                "label": label,
                "pair": pair,
                "op": op.value,
                "scheme": scheme,
                "gbps": round(gbps, 2),
                "runs": repeat,
                "attach_ms": round(attach_ms, 1),
                "register_ms": round(reg_ms, 1),
                "verified": checked,
            }
            out.append(row)
            print(
                f"  {mode:11} {label:18} {pair:13} {op.value:5} {scheme:22} {gbps:8.2f} GB/s"
                f"  ({checked}; register {reg_ms:.0f} ms)",
                flush=True,
            )
    agent.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=int, default=0, help="GPU of the engine and the daemon")
    ap.add_argument("--reader-device", type=int, default=1, help="GPU of the peer")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--label", default="default", help="names the UCX settings of this run")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="append rows to this JSON-lines file")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for mode in args.modes:
        try:
            rows += run_mode(mode, args, args.label)
        except Exception as exc:  # a mode that cannot work here is a finding, not a crash
            print(f"  {mode:11} {args.label:18} FAILED: {type(exc).__name__}: {exc}", flush=True)
            rows.append(
                {"mode": mode, "label": args.label, "error": f"{type(exc).__name__}: {exc}"}
            )
    if args.json:
        with args.json.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
