"""Where the decode daemon's time goes when the host's scheduler places its threads: 16-block
pulls through two real daemons (``bench.control_path``'s setup) with the daemons' and the
client's threads placed on CPUs in several ways, and the decode daemon's CPU per pull for each
of its threads (the main thread, the event loop, named ``main``).

A study, not a tool: it asks whether pinning (each process, or each main thread, to its own
cores; or everything on one core) changes a pull's latency on the host it runs on.

    python -m bench.studies.placement --device cuda --pool dense:num_blocks=600 --pulls 1000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from kvxferd.scenario.control_path import (
    checked_blocks,
    decode_daemon,
    prefill_daemon,
    pulling_pair,
    random_ids,
    stat_cpu_seconds,
)


def threads(pid: int) -> dict[int, float]:
    """CPU seconds so far of each thread of ``pid``."""
    out: dict[int, float] = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            out[int(t)] = stat_cpu_seconds(f"/proc/{pid}/task/{t}/stat")
    return out


def pin(pid: int, main: set[int] | None, rest: set[int] | None) -> None:
    """Pin ``pid``'s main thread to ``main`` and its other threads to ``rest`` (None: leave)."""
    for tid in threads(pid):
        cpus = main if tid == pid else rest
        if cpus:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)


def cpus(text: str) -> set[int] | None:
    if not text:
        return None
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


# name: (decode main, decode rest, prefill main, prefill rest, client)
LAYOUTS = {
    "none": ("", "", "", "", ""),
    "process": ("2-3", "2-3", "4-5", "4-5", "6-7"),
    "mains": ("2", "8-15", "4", "8-15", "6"),
    "one-core": ("2", "2", "2", "2", "2"),
    "two-cores": ("2-3", "2-3", "2-3", "2-3", "2-3"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", default="dense:num_blocks=600")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pulls", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    blocks = checked_blocks(args.pool, 16)
    rows = []
    everything = set(range(os.cpu_count() or 1))
    options = [
        prefill_daemon(args.pool, args.device),
        decode_daemon("decode", args.pool, args.device, "kernel"),
    ]
    with pulling_pair(options) as (ds, puller):
        pre, dec = ds["prefill"].ready, ds["decode"].ready
        assert pre is not None and dec is not None
        rng = np.random.default_rng(0)
        for _ in range(args.warmup):
            puller.pull(random_ids(rng, blocks, 16), random_ids(rng, blocks, 16), socket=True)
        for name in args.layouts.split(","):
            dm, dr, pm, prr, cl = (cpus(x) for x in LAYOUTS[name])
            if any(c is not None and not c <= everything for c in (dm, dr, pm, prr, cl)):
                print(f"{name:10s} skipped: this host has {len(everything)} CPUs", flush=True)
                continue
            pin(dec.pid, dm or everything, dr or everything)
            pin(pre.pid, pm or everything, prr or everything)
            os.sched_setaffinity(0, cl or everything)
            for _ in range(100):
                puller.pull(random_ids(rng, blocks, 16), random_ids(rng, blocks, 16), socket=True)
            before = threads(dec.pid)
            ms: list[float] = []
            t0 = time.perf_counter()
            for _ in range(args.pulls):
                out = puller.pull(
                    random_ids(rng, blocks, 16), random_ids(rng, blocks, 16), socket=True
                )
                ms.append(out.seconds * 1e3)
            wall = time.perf_counter() - t0
            after = threads(dec.pid)
            per = {
                ("main" if t == dec.pid else str(t)): (after[t] - before.get(t, 0.0))
                / args.pulls
                * 1e3
                for t in after
            }
            busy = {k: round(v, 3) for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v}
            row = {
                "layout": name,
                "p50_ms": statistics.median(ms),
                "p90_ms": float(np.percentile(ms, 90)),
                "p99_ms": float(np.percentile(ms, 99)),
                "wall_s": wall,
                "decode_cpu_ms_per_pull": busy,
            }
            rows.append(row)
            print(
                f"{name:10s} p50 {row['p50_ms']:.3f} p90 {row['p90_ms']:.3f}"
                f" p99 {row['p99_ms']:.3f} ms; decode CPU ms/pull {busy}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
