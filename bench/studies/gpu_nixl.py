"""GPU NIXL bench (issue 6): READs between two processes, per descriptor scheme and staged.

Run from the repository root: ``python -m bench.studies.gpu_nixl --reader-device 1 --json out.json``
(owner on cuda:0, reader on ``--reader-device``). Same workload as ``bench.studies.gpu_staging``: 32
layers x ``(4096, 2, 16, 8, 128)`` bf16, 512 random source and destination blocks (1 GiB).
The owner ("prefill") process allocates its pools itself (not CUDA-IPC-imported memory),
registers them as VRAM with its own NIXL agent, and answers commands over a pipe. Rows (median
of ``--repeat``, reader's wall time from posting to completion seen):

* per (layer, block): 16,384 descriptors of 64 KiB between per-layer pools;
* per block, cross-layer layout: 512 descriptors of 2 MiB;
* one contiguous descriptor: the owner's 1 GiB staging buffer into the reader's;
* staged, N chunks: the owner gathers chunk k into its staging buffer (CUDA kernels) and
  announces it on the pipe, the reader READs it into its staging buffer (one descriptor) and
  scatters it into its per-layer pool, chunks overlapping.

Every row is verified: a position-weighted digest of the reader's destination blocks must equal
the owner's digest of the source blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

LAYERS = 32
NUM_BLOCKS = 4096
REQ = 512
BLOCK_BYTES = 2 * 16 * 8 * 128 * 2
ROW = LAYERS * BLOCK_BYTES
REQ_BYTES = REQ * ROW


class Pools:
    """Per-layer pool (32 block views), cross-layer pool (one), staging buffer, on one GPU."""

    def __init__(self, dev: int, *, fill: bool) -> None:
        d = torch.device(f"cuda:{dev}")
        self.dev = dev
        self.layers = [torch.empty(NUM_BLOCKS, BLOCK_BYTES, dtype=torch.uint8, device=d)]
        self.layers += [torch.empty_like(self.layers[0]) for _ in range(LAYERS - 1)]
        self.cross = torch.empty(NUM_BLOCKS, ROW, dtype=torch.uint8, device=d)
        self.staging = torch.empty(REQ_BYTES, dtype=torch.uint8, device=d)
        for t in [*self.layers, self.cross]:
            if fill:
                t.random_(0, 256)
            else:
                t.zero_()

    def regions(self) -> np.ndarray:
        ts = [*self.layers, self.cross, self.staging]
        return np.array([[t.data_ptr(), t.numel(), self.dev] for t in ts], dtype=np.int64)


def digest(views: list[torch.Tensor], ids: np.ndarray) -> int:
    """Sum over blocks of (position + 1) x (block's int64 word sum), wrapping: order-sensitive."""
    idx = torch.from_numpy(ids).to(views[0].device)
    w = torch.arange(1, len(ids) + 1, device=views[0].device, dtype=torch.int64)
    total = torch.zeros((), dtype=torch.int64, device=views[0].device)
    for i, v in enumerate(views):
        sums = v[idx].view(torch.int64).sum(dim=1)
        total += (sums * w * (i + 1)).sum()
    return int(total)


def _owner_main(conn: Connection, dev: int) -> None:
    from kvxferd.kernels import active_backend, gather_blocks
    from kvxferd.nixl import MemType, NixlAgent

    torch.cuda.set_device(dev)
    backend = active_backend()
    agent = NixlAgent(f"gpu-owner-{os.getpid()}", cuda_device=dev)
    agent.start()
    pools = Pools(dev, fill=True)
    agent.register(pools.regions(), MemType.VRAM)
    conn.send((agent.name, agent.metadata(), pools.regions(), backend.describe()))
    stream = torch.cuda.Stream(dev)
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            break
        if cmd == "add_remote":
            agent.add_remote(args[0], args[1])
            conn.send(None)
        elif cmd == "digest":
            which, ids = args
            views = pools.layers if which == "layers" else [pools.cross]
            conn.send(digest(views, ids))
        elif cmd == "gather":  # gather the request in chunks; announce each chunk when ready
            ids, chunks = args
            bounds = np.linspace(0, len(ids), chunks + 1).astype(int)
            events = []
            with torch.cuda.stream(stream):
                for a, b in itertools.pairwise(bounds):
                    gather_blocks(pools.layers, ids[a:b], pools.staging[a * ROW : b * ROW])
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    events.append(ev)
            for k, ev in enumerate(events):
                ev.synchronize()
                conn.send(("ready", k, time.perf_counter()))
    agent.close()


class Owner:
    def __init__(self, dev: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_owner_main, args=(child, dev), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(300):
            raise TimeoutError("owner did not start")
        self.name, self.metadata, self.regions, self.backend = self.conn.recv()

    def call(self, *msg: Any) -> Any:
        self.conn.send(msg)
        if not self.conn.poll(120):
            raise TimeoutError(f"owner did not answer {msg[0]}")
        return self.conn.recv()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(("stop",))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def _descs(base: int, ids: np.ndarray, length: int, dev: int) -> np.ndarray:
    out = np.empty((len(ids), 3), dtype=np.int64)
    out[:, 0] = base + ids * length
    out[:, 1] = length
    out[:, 2] = dev
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--owner-device", type=int, default=0)
    ap.add_argument("--reader-device", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from kvxferd.kernels import active_backend, scatter_blocks
    from kvxferd.nixl import MemType, NixlAgent, XferOp, XferState

    od, rd = args.owner_device, args.reader_device
    pair = f"{od}->{rd}"
    torch.cuda.set_device(rd)
    print(f"reader {active_backend().describe()}", flush=True)
    owner = Owner(od)
    print(f"owner {owner.backend}", flush=True)
    agent = NixlAgent(f"gpu-reader-{os.getpid()}", cuda_device=rd)
    agent.start()
    pools = Pools(rd, fill=False)
    local = pools.regions()
    agent.register(local, MemType.VRAM)
    agent.add_remote(owner.name, owner.metadata)
    owner.call("add_remote", agent.name, agent.metadata())
    remote = owner.regions
    rng = np.random.default_rng(args.seed)
    sids = rng.choice(NUM_BLOCKS, REQ, replace=False).astype(np.int64)
    dids = rng.choice(NUM_BLOCKS, REQ, replace=False).astype(np.int64)
    rows: list[dict[str, Any]] = []

    def wait(h: Any) -> None:
        while agent.poll(h) is XferState.IN_PROGRESS:
            pass
        agent.release(h)

    def read(loc: np.ndarray, rem: np.ndarray) -> None:
        wait(
            agent.post(
                XferOp.READ,
                loc,
                rem,
                peer=owner.name,
                local_mem=MemType.VRAM,
                remote_mem=MemType.VRAM,
            )
        )

    def measure(name: str, fn: Callable[[], None], descs: int, check: Callable[[], None]) -> None:
        fn()  # warm (connection set-up, IPC handle import)
        check()
        secs = []
        for _ in range(args.repeat):
            torch.cuda.synchronize(rd)
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(rd)
            secs.append(time.perf_counter() - t0)
        gbps = REQ_BYTES / statistics.median(secs) / 1e9
        rows.append({"row": name, "gbps": gbps, "descriptors": descs, "pair": pair})
        print(f"  {name:58} {gbps:8.1f} GB/s  ({descs} descriptors)", flush=True)

    def check_layers() -> None:
        torch.cuda.synchronize(rd)
        if digest(pools.layers, dids) != owner.call("digest", "layers", sids):
            raise AssertionError("per-layer destination blocks differ from the owner's")
        for t in pools.layers:
            t.zero_()
        torch.cuda.synchronize(rd)

    # per (layer, block)
    loc = np.concatenate([_descs(int(local[i, 0]), dids, BLOCK_BYTES, rd) for i in range(LAYERS)])
    rem = np.concatenate([_descs(int(remote[i, 0]), sids, BLOCK_BYTES, od) for i in range(LAYERS)])
    measure(
        f"NIXL {pair} 1 desc per (layer, block)", lambda: read(loc, rem), len(loc), check_layers
    )

    # per block, cross-layer
    cl = _descs(int(local[LAYERS, 0]), dids, ROW, rd)
    cr = _descs(int(remote[LAYERS, 0]), sids, ROW, od)

    def check_cross() -> None:
        torch.cuda.synchronize(rd)
        if digest([pools.cross], dids) != owner.call("digest", "cross", sids):
            raise AssertionError("cross-layer destination blocks differ from the owner's")
        pools.cross.zero_()
        torch.cuda.synchronize(rd)

    measure(
        f"NIXL {pair} 1 desc per block, cross-layer", lambda: read(cl, cr), len(cl), check_cross
    )

    # one contiguous descriptor (staging -> staging)
    sl = np.array([[int(local[LAYERS + 1, 0]), REQ_BYTES, rd]], dtype=np.int64)
    sr = np.array([[int(remote[LAYERS + 1, 0]), REQ_BYTES, od]], dtype=np.int64)
    measure(f"NIXL {pair} 1 contiguous desc (1 GiB)", lambda: read(sl, sr), 1, lambda: None)

    # staged: owner gathers chunks, reader READs each and scatters it
    scatter_stream = torch.cuda.Stream(rd)

    def staged(chunks: int, stages: dict[str, float] | None = None) -> None:
        bounds = np.linspace(0, REQ, chunks + 1).astype(int)
        scatter_stream.wait_stream(torch.cuda.current_stream(rd))
        t_cmd = time.perf_counter()
        ready: list[float] = []
        post_s = read_s = 0.0
        posted: dict[int, float] = {}
        last_done = 0.0
        owner.conn.send(("gather", sids, chunks))
        inflight: dict[int, Any] = {}
        announced = scattered = 0
        while scattered < chunks:
            while announced < chunks and owner.conn.poll(0 if inflight else 60):
                _, k, t_ready = owner.conn.recv()
                ready.append(t_ready - t_cmd)
                a, b = int(bounds[k]), int(bounds[k + 1])
                lo, n = a * ROW, (b - a) * ROW
                t_post = time.perf_counter()
                inflight[k] = agent.post(
                    XferOp.READ,
                    np.array([[int(local[LAYERS + 1, 0]) + lo, n, rd]], dtype=np.int64),
                    np.array([[int(remote[LAYERS + 1, 0]) + lo, n, od]], dtype=np.int64),
                    peer=owner.name,
                    local_mem=MemType.VRAM,
                    remote_mem=MemType.VRAM,
                )
                posted[k] = time.perf_counter()
                post_s += posted[k] - t_post
                announced += 1
            for k in sorted(inflight):
                if agent.poll(inflight[k]) is XferState.DONE:
                    last_done = time.perf_counter()
                    read_s += last_done - posted[k]
                    agent.release(inflight.pop(k))
                    a, b = int(bounds[k]), int(bounds[k + 1])
                    with torch.cuda.stream(scatter_stream):
                        scatter_blocks(pools.layers, dids[a:b], pools.staging[a * ROW : b * ROW])
                    scattered += 1
        torch.cuda.current_stream(rd).wait_stream(scatter_stream)
        torch.cuda.synchronize(rd)
        if stages is not None:
            stages.update(
                first_chunk_gathered_ms=ready[0] * 1e3,
                last_chunk_gathered_ms=ready[-1] * 1e3,
                post_ms_sum=post_s * 1e3,
                read_ms_sum=read_s * 1e3,
                last_read_done_ms=(last_done - t_cmd) * 1e3,
                total_ms=(time.perf_counter() - t_cmd) * 1e3,
            )

    for chunks in args.chunks:
        measure(
            f"NIXL {pair} staged {chunks:>2} chunks (gather+READ+scatter)",
            lambda chunks=chunks: staged(chunks),
            chunks,
            check_layers,
        )
        stages: dict[str, float] = {}
        staged(chunks, stages)  # one more run, instrumented: where the time goes
        rows[-1]["stages"] = stages
        text = ", ".join(f"{k}={v:.2f}" for k, v in stages.items())
        print(f"    stages (ms after the gather command): {text}", flush=True)
    agent.close()
    owner.close()
    if args.json:
        args.json.write_text(json.dumps({"pair": pair, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
