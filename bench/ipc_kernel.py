"""KERNEL copy bench (issue 13): the range-copy kernel reading another process's memory over
CUDA IPC, against the raw copy of the same bytes, per grid cap.

Run from the repository root on a machine with a CUDA GPU::

    python -m bench.ipc_kernel --json ipc.json

Workload (docs/nixl.md §5): 32 layers x 4096 blocks x 64 KiB (Llama-3-8B shaped, per layer), a
request of 512 blocks = 1 GiB, random or contiguous block IDs (destination IDs random or
contiguous too). An owner process (``spawn``) allocates and fills the pool and exports every
layer over CUDA IPC; this process maps them (:class:`kvxferd.ipc.mapping.MappingCache`, the
daemon's code) and copies into its own pool. Rows, median of ``--repeat``:

* raw: torch ``copy_`` of one 1 GiB tensor, and of 32 per-layer 32 MiB slices (the limit);
* kernel, imported: ``kvxferd.kernels.copy_ranges`` from the mapped pool, per grid cap
  (``transfer.kernel_max_ctas``; 0 = two per SM), with the daemon's piece size;
* kernel, owned: the same from a pool this process allocated (imported vs owned);
* torch index ops (index_select + index_copy_ per layer), the twin's way, for reference.

Two timings per row: ``wall`` (host clock around the call and a synchronisation: what a pull
sees, table upload included) and ``gpu`` (CUDA events around the launch). Every kernel row's
bytes are checked once on 16 sampled (layer, block) pairs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
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
BLOCK = 64 << 10
GIB = 1 << 30


def _owner(conn: Connection, layers: int, blocks: int) -> None:
    from kvxferd.attach.cuda_ipc import export_tensor

    torch.cuda.set_device(0)
    pool = []
    for i in range(layers):
        t = torch.empty(blocks * BLOCK, dtype=torch.uint8, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(1000 + i)
        t.view(torch.int32).random_(generator=g)
        pool.append(t)
    torch.cuda.synchronize()
    out = []
    for t in pool:
        e = export_tensor(t, t.numel())
        out.append((e.handle, e.offset, e.nbytes))
    conn.send(out)
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            return
        layer, ids = cmd
        rows = pool[layer].view(blocks, BLOCK)[torch.as_tensor(ids, device="cuda")]
        conn.send(rows.sum(dim=1, dtype=torch.int64).cpu().tolist())


def _time(fn: Callable[[], None], repeat: int) -> tuple[float, float]:
    """(median wall seconds, median GPU seconds) over ``repeat`` runs after 3 warm-ups."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    wall, gpu = [], []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - t0)
        gpu.append(a.elapsed_time(b) / 1e3)
    return statistics.median(wall), statistics.median(gpu)


def _raw_one(repeat: int) -> tuple[float, float]:
    src = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    out = _time(lambda: dst.copy_(src), repeat)
    return out


def _ids(pattern: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if pattern == "contiguous":
        a, b = (int(rng.integers(0, NUM_BLOCKS - REQ)) for _ in range(2))
        return np.arange(a, a + REQ), np.arange(b, b + REQ)
    return (
        rng.choice(NUM_BLOCKS, REQ, replace=False).astype(np.int64),
        rng.choice(NUM_BLOCKS, REQ, replace=False).astype(np.int64),
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--caps", default="32,64,132,264,0", help="grid caps to measure")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    from kvxferd.blocks.ranges import RegionRanges, TransferPlan
    from kvxferd.ipc.host import device_uuid
    from kvxferd.ipc.mapping import MappingCache
    from kvxferd.ipc.publish import IpcPool, IpcRegion
    from kvxferd.ipc.reader import PIECE_BYTES, pieces
    from kvxferd.kernels import BackendName, active_backend, copy_ranges

    backend = active_backend()
    print(f"kernels: {backend.describe()}", flush=True)
    if backend.name is not BackendName.CUDA:
        print("no CUDA kernels: nothing to measure", file=sys.stderr)
        return 1
    torch.cuda.set_device(0)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_owner, args=(child, LAYERS, NUM_BLOCKS), daemon=True)
    proc.start()
    handles = conn.recv()
    uuid = device_uuid(0)
    assert uuid is not None
    ipc = IpcPool(tuple(IpcRegion(h, o, n, uuid) for h, o, n in handles))
    cache = MappingCache(device=0)
    maps = cache.get(("owner", "bench", 1), ipc)
    layer_bytes = NUM_BLOCKS * BLOCK
    dst = [torch.zeros(layer_bytes, dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
    owned = [torch.empty(layer_bytes, dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
    for t in owned:
        t.view(torch.int32).random_()
    rows: list[dict[str, Any]] = []

    def row(name: str, seconds: tuple[float, float], nbytes: int, **extra: Any) -> None:
        wall, gpu = seconds
        rows.append(
            {
                "row": name,
                "wall_s": wall,
                "gpu_s": gpu,
                "gbps": nbytes / wall / 1e9,
                "gpu_gbps": nbytes / gpu / 1e9,
                **extra,
            }
        )
        print(
            f"  {name:48s} {nbytes / wall / 1e9:9.1f} GB/s wall {nbytes / gpu / 1e9:9.1f} gpu",
            flush=True,
        )

    row("raw copy_ 1 GiB (one tensor)", _raw_one(args.repeat), GIB)
    w = REQ * BLOCK

    def per_layer() -> None:
        for i in range(LAYERS):
            dst[i][:w].copy_(owned[i][:w], non_blocking=True)

    row("raw copy_ 32 x 32 MiB (per layer)", _time(per_layer, args.repeat), LAYERS * w)
    torch.cuda.empty_cache()
    raw = max(r["gbps"] for r in rows)
    rng = np.random.default_rng(0)
    for pattern in ("random", "contiguous"):
        local, remote = _ids(pattern, rng)
        ln = np.full(REQ, BLOCK, dtype=np.int64)
        plan = TransferPlan(
            tuple(
                RegionRanges(i, f"layer.{i}", local * BLOCK, remote * BLOCK, ln)
                for i in range(LAYERS)
            )
        )
        rc, runs = pieces(plan, PIECE_BYTES)
        nbytes = rc.nbytes
        for cap in [int(c) for c in args.caps.split(",")]:
            with maps.use() as src:
                t = _time(
                    lambda src=src, cap=cap, rc=rc: copy_ranges(dst, src, rc, max_ctas=cap),
                    args.repeat,
                )
                row(
                    f"kernel imported {pattern} cap={cap}",
                    t,
                    nbytes,
                    pattern=pattern,
                    cap=cap,
                    pieces=rc.pieces,
                    runs=runs,
                )
            # verify a sample against the owner
            pick = rng.choice(REQ, 16, replace=False)
            for layer in (0, LAYERS - 1):
                conn.send((layer, remote[pick].tolist()))
                want = conn.recv()
                got = dst[layer].view(NUM_BLOCKS, BLOCK)[
                    torch.as_tensor(local[pick], device="cuda")
                ]
                ok = got.sum(dim=1, dtype=torch.int64).cpu().tolist() == want
                rows[-1].setdefault("verified", True)
                rows[-1]["verified"] = rows[-1]["verified"] and ok
            rows[-1]["x_raw"] = rows[-1]["gbps"] / raw
        t = _time(lambda rc=rc: copy_ranges(dst, owned, rc, max_ctas=0), args.repeat)
        row(f"kernel owned {pattern} cap=0", t, nbytes, pattern=pattern, cap=0)
        ls, rs = torch.as_tensor(local, device="cuda"), torch.as_tensor(remote, device="cuda")

        def index_ops(ls: torch.Tensor = ls, rs: torch.Tensor = rs) -> None:
            for i in range(LAYERS):
                d = dst[i].view(NUM_BLOCKS, BLOCK)
                d.index_copy_(0, ls, owned[i].view(NUM_BLOCKS, BLOCK).index_select(0, rs))

        row(
            f"torch index ops {pattern}",
            _time(index_ops, max(3, args.repeat // 4)),
            nbytes,
            pattern=pattern,
        )
    for r in rows:
        r.setdefault("x_raw", r["gbps"] / raw)
    print("")
    print(f"{'row':48s} {'GB/s':>9s} {'x raw':>6s} {'gpu GB/s':>9s} ok")
    for r in rows:
        ok = "" if "verified" not in r else ("yes" if r["verified"] else "NO")
        print(f"{r['row']:48s} {r['gbps']:9.1f} {r['x_raw']:6.2f} {r['gpu_gbps']:9.1f} {ok}")
    if args.json:
        args.json.write_text(json.dumps({"raw_gbps": raw, "rows": rows}, indent=2) + "\n")
    cache.close()
    conn.send("stop")
    proc.join(30)
    return 0 if all(r.get("verified", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
