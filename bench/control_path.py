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
from pathlib import Path

from kvxferd.scenario.control_path import BLOCKS, TINY, measure


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", default=TINY, help=f"both daemons' preset (default {TINY})")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (both daemons on cuda:0)")
    ap.add_argument("--pulls", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--strategy", default="kernel", help="the decode daemon's transfer.strategy")
    ap.add_argument("--blocks", type=int, default=BLOCKS, help=f"blocks per pull ({BLOCKS})")
    ap.add_argument(
        "--gap-ms", type=float, default=0.0, help="idle time before each timed pull (0)"
    )
    ap.add_argument(
        "--distinct",
        type=int,
        default=0,
        help="cycle through this many block-ID lists drawn once (0: new random IDs each pull)",
    )
    ap.add_argument("--json", default="", help="also write the figures here")
    args = ap.parse_args(argv)
    fig = measure(
        args.pool,
        args.device,
        args.pulls,
        args.warmup,
        strategy=args.strategy,
        n=args.blocks,
        gap_s=args.gap_ms / 1e3,
        distinct=args.distinct,
    )
    stages = ", ".join(f"{k} {v:.3f}" for k, v in fig["stages_p50_ms"].items())
    cpu = fig["cpu_ms_per_pull"]
    print(
        f"{fig['pulls']} pulls of {fig['blocks']} blocks ({fig['pool']}, {fig['device']}):"
        f" p50 {fig['p50_ms']:.3f} ms, p90 {fig['p90_ms']:.3f} ms, p99 {fig['p99_ms']:.3f} ms"
    )
    print(f"  stages p50 (ms): {stages}")
    print(
        f"  released after the answer (WatchReleases): p50 {fig['release_p50_ms']:.3f} ms,"
        f" p99 {fig['release_p99_ms']:.3f} ms"
    )
    print(
        f"  CPU per pull: decode daemon {cpu['decode']:.3f} ms, prefill daemon"
        f" {cpu['prefill']:.3f} ms (every thread; wall {fig['wall_s']:.1f} s)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
