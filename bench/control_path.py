"""The daemons' own cost per pull: 16-block pulls on the scheduler socket, one at a time.

A prefill and a decode daemon (``kvxferd serve``, the same-host Peer socket between them), a
client that holds 16 random blocks on the prefill daemon and pulls them with StartPull and
``wait`` on the decode daemon's scheduler socket, then waits for the prefill daemon to release
them (untimed), as ``kvxferd bench``'s latency rows do but with only that one way of waiting.
Prints the pull's p50 / p99 as the client saw it, the stage p50s from the pull's status, and
each daemon's CPU time per pull (``/proc/PID/stat``, every thread), the figure that bounds
how fast a daemon on a busy host can go.

The default pool is tiny (one 8-element head per layer, 32 layers), so the copy is negligible
and the figures are the control path's; ``--pool`` and ``--device`` give the bench's shape:

    python -m bench.control_path                                   # host memory, CMA
    python -m bench.control_path --device cuda --pool dense:num_blocks=600 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvxferd.scenario.client import DaemonClient
from kvxferd.scenario.daemons import DaemonOptions, DaemonSet
from kvxferd.scenario.puller import PULL_DEADLINE_MS, DaemonPuller

BLOCKS = 16
TINY = "dense:num_blocks=80,num_kv_heads=1,head_size=8"


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of every thread of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pool_blocks(pool: str) -> int:
    for part in pool.split(":", 1)[-1].split(","):
        key, _, value = part.partition("=")
        if key.strip() == "num_blocks":
            return int(value)
    raise SystemExit(f"--pool {pool!r} must name num_blocks (the random IDs are drawn from it)")


def measure(
    pool: str, device: str, pulls: int, warmup: int, *, strategy: str, n: int = BLOCKS
) -> dict[str, Any]:
    blocks = _pool_blocks(pool)
    if not 0 < n <= blocks:
        raise SystemExit(f"--blocks {n}: pick 1 to {blocks}, the pool's num_blocks")
    options = [
        DaemonOptions(
            "prefill",
            pool,
            device=device,
            extra=("--set", f"transfer.default_deadline_ms={PULL_DEADLINE_MS}"),
        ),
        DaemonOptions(
            "decode",
            pool,
            device=device,
            extra=("--set", f"transfer.strategy={strategy}"),
            scheduler_socket=True,
        ),
    ]
    rng = np.random.default_rng(0)

    def ids() -> np.ndarray[Any, np.dtype[np.int64]]:
        return rng.choice(blocks, n, replace=False).astype(np.int64)

    with DaemonSet(Path(tempfile.mkdtemp(prefix="kvx-control-")), options) as daemons:
        daemons.start()
        daemons.wait_ready()
        pre, dec = daemons["prefill"].ready, daemons["decode"].ready
        assert pre is not None and dec is not None
        prefill = DaemonClient("prefill", pre.grpc, pre.engine_socket)
        decode = DaemonClient(
            "decode", dec.grpc, dec.engine_socket, scheduler_socket=dec.scheduler_socket
        )
        puller = DaemonPuller(prefill, decode)
        try:
            for _ in range(warmup):
                puller.pull(ids(), ids(), socket=True)
            cpu0 = {"decode": cpu_seconds(dec.pid), "prefill": cpu_seconds(pre.pid)}
            ms: list[float] = []
            stages: dict[str, list[float]] = {}
            strategies: set[int] = set()
            t0 = time.perf_counter()
            for _ in range(pulls):
                out = puller.pull(ids(), ids(), socket=True)
                ms.append(out.seconds * 1e3)
                strategies.add(out.status.strategy)
                for st in out.status.stages:
                    stages.setdefault(st.name, []).append(st.seconds * 1e3)
            wall = time.perf_counter() - t0
            cpu = {
                "decode": cpu_seconds(dec.pid) - cpu0["decode"],
                "prefill": cpu_seconds(pre.pid) - cpu0["prefill"],
            }
            daemons.check_alive()
        finally:
            puller.close()
            prefill.close()
            decode.close()
    return {
        "pool": pool,
        "device": device,
        "strategy": strategy,
        "strategies_seen": sorted(strategies),
        "pulls": pulls,
        "blocks": n,
        "wall_s": wall,
        "p50_ms": statistics.median(ms),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "stages_p50_ms": {k: statistics.median(v) for k, v in stages.items()},
        "cpu_ms_per_pull": {k: v / pulls * 1e3 for k, v in cpu.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", default=TINY, help=f"both daemons' preset (default {TINY})")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (both daemons on cuda:0)")
    ap.add_argument("--pulls", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--strategy", default="kernel", help="the decode daemon's transfer.strategy")
    ap.add_argument("--blocks", type=int, default=BLOCKS, help=f"blocks per pull ({BLOCKS})")
    ap.add_argument("--json", default="", help="also write the figures here")
    args = ap.parse_args(argv)
    fig = measure(
        args.pool, args.device, args.pulls, args.warmup, strategy=args.strategy, n=args.blocks
    )
    stages = ", ".join(f"{k} {v:.3f}" for k, v in fig["stages_p50_ms"].items())
    cpu = fig["cpu_ms_per_pull"]
    print(
        f"{fig['pulls']} pulls of {fig['blocks']} blocks ({fig['pool']}, {fig['device']}):"
        f" p50 {fig['p50_ms']:.3f} ms, p90 {fig['p90_ms']:.3f} ms, p99 {fig['p99_ms']:.3f} ms"
    )
    print(f"  stages p50 (ms): {stages}")
    print(
        f"  CPU per pull: decode daemon {cpu['decode']:.3f} ms, prefill daemon"
        f" {cpu['prefill']:.3f} ms (every thread; wall {fig['wall_s']:.1f} s)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
