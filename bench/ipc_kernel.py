"""KERNEL copy bench (issue 13): the range-copy kernels reading another process's memory over
CUDA IPC, against the raw copy of the same bytes, per kernel and grid cap, and whole
:meth:`KernelReader.pull` calls (host work, launch, event wait) without the daemons.

Run from the repository root on a machine with a CUDA GPU::

    python -m bench.ipc_kernel --json ipc.json

Workload (docs/nixl.md §5): 32 layers x 4096 blocks x 64 KiB (Llama-3-8B shaped, per layer), a
request of 512 blocks = 1 GiB, random or contiguous block IDs (destination IDs random or
contiguous too). An owner process (``spawn``) allocates and fills the pool and exports every
layer over CUDA IPC; this process maps them (:class:`kvxferd.ipc.mapping.MappingCache`, the
daemon's code) and copies into its own pool (a ``dense`` :class:`kvxferd.pool.KVPool`). Rows:

* raw: torch ``copy_`` of one 1 GiB tensor, and of 32 per-layer 32 MiB slices (the limit);
* copy, imported, group: ``kvxferd.kernels.copy_groups`` on the daemon's grouped pieces (the
  runs once, repeated over the 32 layers by the kernel), per grid cap;
* copy, imported: ``kvxferd.kernels.copy_ranges`` on the daemon's pieces, for each kernel
  (``stride``: grid-stride over the pieces end to end; ``cta``: one CTA per piece, the previous
  one) and grid cap (``transfer.kernel_max_ctas``, default 64; 0 = all resident CTAs);
* copy, owned: the stride kernel from a pool this process allocated (imported vs owned);
* stride, pieces in source order: the same pieces sorted by source address;
* torch index ops (index_select + index_copy_ per layer), the twin's way, for reference;
* pull: ``KernelReader.pull`` end to end on an event loop, on plans made by the daemon's
  planner (``plan_pull``), 1 GiB random and contiguous and 16-block (32 MiB) random pulls, per
  kernel at cap 64 and 0 (the stride kernel grouped, as the daemon runs it, and flattened),
  with the reader's own split (``cut``: pieces; ``check``: bounds checks and launch tables;
  ``launch``: checks, tables, upload and kernel launch; ``wait``: the event; ``hop``: the
  thread call seen from the loop minus those); ``ready`` rows do the cut and checks first
  (:meth:`KernelReader.ready`, as the daemon does while the lease confirmation is in flight)
  and time only the pull that follows;
* launch parts: a ready 16-block pull's launch taken apart (a device and stream context
  entered, the op call, the completion event), synchronised between repeats.

Copy rows: median of ``--repeat`` of ``wall`` (host clock around the call and a
synchronisation: table build and upload included) and ``gpu`` (CUDA events around it). Every
copy and pull row's bytes are checked on 16 sampled (layer, block) pairs against the owner.
"""

from __future__ import annotations

import argparse
import asyncio
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
SMALL = 16
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


def _time(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(median wall seconds, median GPU seconds) over ``repeat`` runs after 3 warm-ups."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    wall, gpu = [], []
    for _ in range(repeat):
        a = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        b = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - t0)
        gpu.append(a.elapsed_time(b) / 1e3)
    return statistics.median(wall), statistics.median(gpu)


def _ids(pattern: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if pattern == "contiguous":
        a, b = (int(rng.integers(0, NUM_BLOCKS - n)) for _ in range(2))
        return np.arange(a, a + n), np.arange(b, b + n)
    return (
        rng.choice(NUM_BLOCKS, n, replace=False).astype(np.int64),
        rng.choice(NUM_BLOCKS, n, replace=False).astype(np.int64),
    )


class Bench:
    """The owner process, the mapped pool, this process's pool, and the rows measured."""

    def __init__(self, repeat: int) -> None:
        from kvxferd.ipc.host import device_uuid
        from kvxferd.ipc.mapping import MappingCache
        from kvxferd.ipc.publish import IpcPool, IpcRegion
        from kvxferd.layout.presets import preset
        from kvxferd.pool import KVPool

        self.repeat = repeat
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_owner, args=(child, LAYERS, NUM_BLOCKS), daemon=True)
        self.proc.start()
        handles = self.conn.recv()
        uuid = device_uuid(0)
        assert uuid is not None
        self.ipc = IpcPool(tuple(IpcRegion(h, o, n, uuid) for h, o, n in handles))
        self.key = ("owner", "bench", 1)
        self.cache = MappingCache(device=0)
        self.maps = self.cache.get(self.key, self.ipc)
        self.pool = KVPool.allocate(
            preset("dense", num_blocks=NUM_BLOCKS, num_layers=LAYERS), device="cuda"
        )
        from kvxferd.ipc.reader import region_bytes

        self.dst = region_bytes(self.pool)
        assert self.dst[0].numel() == NUM_BLOCKS * BLOCK, "the dense preset's block is 64 KiB"
        self.rows: list[dict[str, Any]] = []
        self.rng = np.random.default_rng(0)

    def row(self, name: str, nbytes: int, wall: float, gpu: float = 0.0, **extra: Any) -> None:
        r = {"row": name, "wall_s": wall, "gbps": nbytes / wall / 1e9, **extra}
        if gpu:
            r.update(gpu_s=gpu, gpu_gbps=nbytes / gpu / 1e9)
        self.rows.append(r)
        more = f" gpu {nbytes / gpu / 1e9:8.1f}" if gpu else ""
        print(f"  {name:52s} {nbytes / wall / 1e9:8.1f} GB/s wall{more}", flush=True)

    def verify(self, local: np.ndarray, remote: np.ndarray) -> bool:
        """16 sampled blocks of the first and last layer equal the owner's."""
        pick = self.rng.choice(local.size, min(16, local.size), replace=False)
        ok = True
        for layer in (0, LAYERS - 1):
            self.conn.send((layer, remote[pick].tolist()))
            want = self.conn.recv()
            view = self.dst[layer].view(NUM_BLOCKS, BLOCK)
            got = view[torch.as_tensor(local[pick], device="cuda")]
            ok = ok and got.sum(dim=1, dtype=torch.int64).cpu().tolist() == want
            view[torch.as_tensor(local, device="cuda")] = 0  # the next row must write them again
        return ok

    def raw(self) -> float:
        src = torch.empty(GIB, dtype=torch.uint8, device="cuda")
        dst = torch.empty(GIB, dtype=torch.uint8, device="cuda")
        self.row("raw copy_ 1 GiB (one tensor)", GIB, *_time(lambda: dst.copy_(src), self.repeat))
        src = dst = torch.empty(0)
        w = REQ * BLOCK
        owned = self.owned()

        def per_layer() -> None:
            for i in range(LAYERS):
                self.dst[i][:w].copy_(owned[i][:w], non_blocking=True)

        self.row("raw copy_ 32 x 32 MiB (per layer)", LAYERS * w, *_time(per_layer, self.repeat))
        torch.cuda.empty_cache()
        return float(max(r["gbps"] for r in self.rows))

    def owned(self) -> list[torch.Tensor]:
        if not hasattr(self, "_owned"):
            self._owned = [
                torch.empty(NUM_BLOCKS * BLOCK, dtype=torch.uint8, device="cuda")
                for _ in range(LAYERS)
            ]
            for t in self._owned:
                t.view(torch.int32).random_()
        return self._owned

    def copies(self, pattern: str, caps: list[int]) -> None:
        from kvxferd.blocks.ranges import RegionRanges, TransferPlan
        from kvxferd.ipc.pieces import group_pieces, pieces
        from kvxferd.kernels import CopyKernel, RangeCopy, Regions, copy_groups, copy_ranges

        local, remote = _ids(pattern, REQ, self.rng)
        arrays = (local * BLOCK, remote * BLOCK, np.full(REQ, BLOCK, dtype=np.int64))
        # Every layer shares one set of arrays, as the daemon's planner makes them.
        plan = TransferPlan(tuple(RegionRanges(i, f"layer.{i}", *arrays) for i in range(LAYERS)))
        rc, runs = pieces(plan)
        info: dict[str, Any] = {"pattern": pattern, "pieces": rc.pieces, "runs": runs}
        info["piece_bytes"] = int(rc.length.max())
        d = Regions.of("dst", self.dst)
        with self.maps.use() as mapped:
            s = Regions.of("src", mapped)
            for kernel in (CopyKernel.STRIDE, CopyKernel.CTA_PER_PIECE):
                for cap in caps:

                    def one(k: CopyKernel = kernel, c: int = cap) -> str:
                        return copy_ranges(d, s, rc, max_ctas=c, kernel=k)

                    t = _time(one, self.repeat)
                    name = f"copy imported {pattern} {kernel.name.lower()} cap={cap}"
                    self.row(name, rc.nbytes, *t, kernel=kernel.name, cap=cap, **info)
                    self.rows[-1]["verified"] = self.verify(local, remote)
            gs, _ = group_pieces(plan)
            assert isinstance(gs, list)
            for cap in caps:

                def grouped(c: int = cap) -> str:
                    return copy_groups(d, s, gs, max_ctas=c)

                t = _time(grouped, self.repeat)
                self.row(f"copy imported {pattern} group cap={cap}", rc.nbytes, *t, cap=cap, **info)
                self.rows[-1]["verified"] = self.verify(local, remote)
            order = np.argsort(s.base[rc.region] + rc.src_offset, kind="stable")
            by_src = RangeCopy(
                rc.region[order], rc.dst_offset[order], rc.src_offset[order], rc.length[order]
            )
            t = _time(lambda: copy_ranges(d, s, by_src, max_ctas=0), self.repeat)
            self.row(f"copy imported {pattern} stride cap=0 source order", rc.nbytes, *t, **info)
            self.rows[-1]["verified"] = self.verify(local, remote)
        t = _time(lambda: copy_ranges(d, self.owned(), rc, max_ctas=0), self.repeat)
        self.row(f"copy owned {pattern} stride cap=0", rc.nbytes, *t, **info)
        ls, rs = torch.as_tensor(local, device="cuda"), torch.as_tensor(remote, device="cuda")

        def index_ops() -> None:
            for i in range(LAYERS):
                view = self.dst[i].view(NUM_BLOCKS, BLOCK)
                view.index_copy_(0, ls, self.owned()[i].view(NUM_BLOCKS, BLOCK).index_select(0, rs))

        t = _time(index_ops, max(3, self.repeat // 4))
        self.row(f"torch index ops {pattern}", rc.nbytes, *t, pattern=pattern)

    def pulls(
        self,
        pattern: str,
        n: int,
        count: int,
        cap: int,
        kernel: Any,
        *,
        grouped: bool = True,
        ready: bool = False,
    ) -> None:
        from kvxferd.blocks import plan_pull
        from kvxferd.ipc.reader import KernelJob, KernelReader

        spec = self.pool.spec
        reader = KernelReader(self.pool, self.cache, max_ctas=cap, kernel=kernel, grouped=grouped)
        assert reader.prepare(self.key, self.ipc) is None
        walls: list[float] = []
        split: dict[str, list[float]] = {k: [] for k in ("cut", "check", "launch", "wait", "hop")}
        ok = True

        async def run() -> None:
            nonlocal ok
            for i in range(count + 3):
                local, remote = _ids(pattern, n, self.rng)
                # The daemon's planner: every layer shares one set of offset arrays.
                plan = plan_pull(spec, spec, [local], [remote], prefix_caching=False).per_rank[0]
                job = KernelJob("t", "owner", "-", self.key, self.ipc, time.monotonic() + 10)
                done = reader.ready(self.key, self.ipc, plan) if ready else None
                t0 = time.perf_counter()
                res = await reader.pull(job, plan, (local,), done)
                wall = time.perf_counter() - t0
                assert res.status.name == "DONE", res.reason
                if i < 3:
                    continue  # warm-up
                walls.append(wall)
                last = reader.last
                assert last.ready is ready
                split["cut"].append(last.cut)
                split["check"].append(last.check)
                split["launch"].append(last.launch)
                split["wait"].append(last.wait)
                ahead = 0.0 if ready else last.cut  # check is part of launch
                split["hop"].append(last.call - ahead - last.launch - last.wait)
                if i == 3:
                    ok = self.verify(local, remote)

        asyncio.run(run())
        walls.sort()
        p99 = walls[min(len(walls) - 1, int(0.99 * len(walls)))]
        med = {k: statistics.median(v) * 1e3 for k, v in split.items()}
        how = kernel.name.lower() + (" grouped" if reader.grouped else "")
        how += " ready" if ready else ""
        name = f"pull {pattern} {n} blocks {how} cap={cap}"
        self.row(name, n * LAYERS * BLOCK, statistics.median(walls), pulls=count, verified=ok)
        self.rows[-1].update(p50_ms=statistics.median(walls) * 1e3, p99_ms=p99 * 1e3)
        self.rows[-1].update({f"{k}_ms": v for k, v in med.items()})
        print(
            f"  {'':52s} p50 {statistics.median(walls) * 1e3:.3f} ms p99 {p99 * 1e3:.3f};"
            + "".join(f" {k} {v:.3f}" for k, v in med.items()),
            flush=True,
        )

    def launch_parts(self, n: int, count: int, cap: int) -> None:
        """A ready random ``n``-block pull's launch, part by part (ms, medians; synchronised
        between repeats): entering and leaving a device and stream context (what the reader
        saves by passing its stream to the op), the op call (the kernel launch, and for a
        table too big to travel with it, the table's pinned copy and upload), the completion
        event (created and recorded), and the event's first successful query."""
        from kvxferd.blocks import plan_pull
        from kvxferd.ipc.reader import KernelReader
        from kvxferd.kernels import run_copy

        reader = KernelReader(self.pool, self.cache, max_ctas=cap)
        assert reader.prepare(self.key, self.ipc) is None
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        parts: dict[str, list[float]] = {k: [] for k in ("contexts", "op", "event", "done")}
        for i in range(count + 3):
            local, remote = _ids("random", n, self.rng)
            plan = plan_pull(
                self.pool.spec, self.pool.spec, [local], [remote], prefix_caching=False
            )
            ready = reader.ready(self.key, self.ipc, plan.per_rank[0])
            assert ready is not None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.device(0), torch.cuda.stream(stream):
                pass
            t1 = time.perf_counter()
            t2 = time.perf_counter()
            run_copy(ready.copy, max_ctas=cap, stream=stream.cuda_stream)
            t3 = time.perf_counter()
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(stream)
            t4 = time.perf_counter()
            while not ev.query():  # type: ignore[no-untyped-call]
                pass
            t5 = time.perf_counter()
            if i >= 3:
                for k, v in zip(parts, (t1 - t0, t3 - t2, t4 - t3, t5 - t4), strict=True):
                    parts[k].append(v)
        med = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
        self.rows.append(
            {
                "row": f"launch parts {n} blocks cap={cap}",
                "gbps": 0.0,
                **{f"{k}_ms": v for k, v in med.items()},
            }
        )
        print(
            f"launch parts, {n} random blocks, cap {cap} (ms):"
            + "".join(f" {k} {v:.4f}" for k, v in med.items()),
            flush=True,
        )

    def close(self) -> None:
        self.cache.close()
        self.conn.send("stop")
        self.proc.join(30)


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--caps", default="64,132,264,0", help="grid caps of the copy rows")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--pulls", type=int, default=100, help="16-block pulls per pull row")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    from kvxferd.kernels import BackendName, CopyKernel, active_backend

    backend = active_backend()
    print(f"kernels: {backend.describe()}", flush=True)
    if backend.name is not BackendName.CUDA:
        print("no CUDA kernels: nothing to measure", file=sys.stderr)
        return 1
    torch.cuda.set_device(0)
    b = Bench(args.repeat)
    raw = b.raw()
    caps = [int(c) for c in args.caps.split(",")]
    for pattern in ("random", "contiguous"):
        b.copies(pattern, caps)
    for kernel, grouped in (
        (CopyKernel.STRIDE, True),
        (CopyKernel.STRIDE, False),
        (CopyKernel.CTA_PER_PIECE, False),
    ):
        for cap in (64, 0):
            b.pulls("random", REQ, max(5, args.repeat // 2), cap, kernel, grouped=grouped)
            b.pulls("contiguous", REQ, max(5, args.repeat // 2), cap, kernel, grouped=grouped)
            b.pulls("random", SMALL, args.pulls, cap, kernel, grouped=grouped)
    for cap in (64, 0):  # as the daemon runs them: cut and checked ahead
        b.pulls("random", REQ, max(5, args.repeat // 2), cap, CopyKernel.STRIDE, ready=True)
        b.pulls("random", SMALL, args.pulls, cap, CopyKernel.STRIDE, ready=True)
    b.launch_parts(SMALL, args.pulls, 64)
    b.rows = [r for r in b.rows if r["gbps"] > 0] + [r for r in b.rows if r["gbps"] <= 0]
    for r in b.rows:
        r["x_raw"] = r["gbps"] / raw
    print("")
    print(f"{'row':52s} {'GB/s':>8s} {'x raw':>6s} {'gpu GB/s':>9s} {'p50 ms':>7s} ok")
    for r in b.rows:
        ok = "" if "verified" not in r else ("yes" if r["verified"] else "NO")
        gpu = f"{r['gpu_gbps']:9.1f}" if "gpu_gbps" in r else f"{'':9s}"
        p50 = f"{r['p50_ms']:7.3f}" if "p50_ms" in r else f"{'':7s}"
        print(f"{r['row']:52s} {r['gbps']:8.1f} {r['x_raw']:6.2f} {gpu} {p50} {ok}")
    if args.json:
        args.json.write_text(json.dumps({"raw_gbps": raw, "rows": b.rows}, indent=2) + "\n")
    b.close()
    return 0 if all(r.get("verified", True) for r in b.rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
