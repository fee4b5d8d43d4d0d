"""Two decode daemons, one prefill daemon, pulls alternating between them: an A/B of the decode
daemon's cost per pull that the machine's drift cannot tilt.

``bench.control_path`` run once per tree and round compares runs made a minute apart, and on the
lent GPU hosts the same code moved by 0.2 ms between such runs (docs/benchmarks.md, session 15),
more than most changes. Here one prefill daemon (this tree) serves two decode daemons: ``a``
runs the tree at ``--base`` (a ``git archive`` of another commit: its ``kvxferd`` package), ``b``
this tree. Each pair of pulls goes to both, in a random order, on the same machine state; the
report gives each side's p50 / p99, the stage p50s, each decode daemon's CPU per pull, and the
median of the per-pair differences (b - a) with a bootstrap 95 % interval.

The interval covers the pairs of one run, not what differs between runs: on the 2-core VM an
A/A run (both decode daemons on one tree) gave -11 µs (-33 to +10) once and +42 µs (+23 to
+61) the next, the daemons' placement on the cores favouring one slot. ``--rounds 2`` (or any
even number) swaps the trees between the two decode daemons every round and reports the mean
of the rounds' medians (this tree minus the base), which cancels a slot's advantage.

    python -m bench.control_ab --base _base                       # host memory, CMA
    python -m bench.control_ab --base _base --device cuda --pool dense:num_blocks=600 \\
        --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvxferd.scenario.client import DaemonClient
from kvxferd.scenario.control_path import BLOCKS, TINY, cpu_seconds, pool_blocks
from kvxferd.scenario.daemons import DaemonOptions, DaemonSet
from kvxferd.scenario.puller import PULL_DEADLINE_MS, DaemonPuller

SIDES = ("a", "b")


def _env(tree: Path) -> dict[str, str]:
    """The environment of a daemon that must import ``tree``'s kvxferd: first on the path, and
    the working directory kept off it (PYTHONSAFEPATH: ``-m`` would put it first)."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *rest]), "PYTHONSAFEPATH": "1"}


def measure(args: argparse.Namespace, a: Path, b: Path, seed: int) -> dict[str, Any]:
    """One run: decode daemon ``a`` on tree ``a``, ``b`` on tree ``b``."""
    blocks = pool_blocks(args.pool)
    here = Path(__file__).resolve().parent.parent
    decode = ("--set", f"transfer.strategy={args.strategy}")
    options = [
        DaemonOptions(
            "prefill",
            args.pool,
            device=args.device,
            extra=("--set", f"transfer.default_deadline_ms={PULL_DEADLINE_MS}"),
        ),
        *(
            DaemonOptions(s, args.pool, device=args.device, extra=decode, scheduler_socket=True)
            for s in SIDES
        ),
    ]
    rng = np.random.default_rng(seed)

    def ids() -> np.ndarray[Any, np.dtype[np.int64]]:
        out: np.ndarray[Any, np.dtype[np.int64]] = rng.choice(blocks, args.blocks, replace=False)
        return out.astype(np.int64)

    with (
        tempfile.TemporaryDirectory(prefix="kvx-ab-") as workdir,
        DaemonSet(Path(workdir), options) as daemons,
    ):
        for d, tree in zip(daemons, (here, a, b), strict=True):
            d.start(_env(tree))
        daemons.wait_ready()
        ready = {d.name: d.ready for d in daemons}
        pre = ready["prefill"]
        assert pre is not None
        prefill = DaemonClient("prefill", pre.grpc, pre.engine_socket)
        clients, pullers = {}, {}
        for s in SIDES:
            r = ready[s]
            assert r is not None
            clients[s] = DaemonClient(
                s, r.grpc, r.engine_socket, scheduler_socket=r.scheduler_socket
            )
            pullers[s] = DaemonPuller(prefill, clients[s])
        ms: dict[str, list[float]] = {s: [] for s in SIDES}
        stages: dict[str, dict[str, list[float]]] = {s: {} for s in SIDES}
        try:
            for _ in range(args.warmup):
                for s in SIDES:
                    pullers[s].pull(ids(), ids(), socket=True)
            pids = {s: r.pid for s, r in ready.items() if r is not None}
            cpu0 = {s: cpu_seconds(pids[s]) for s in SIDES}
            t0 = time.perf_counter()
            for _ in range(args.pulls):
                for s in SIDES if rng.random() < 0.5 else SIDES[::-1]:
                    out = pullers[s].pull(ids(), ids(), socket=True)
                    ms[s].append(out.seconds * 1e3)
                    for st in out.status.stages:
                        stages[s].setdefault(st.name, []).append(st.seconds * 1e3)
            wall = time.perf_counter() - t0
            cpu = {s: (cpu_seconds(pids[s]) - cpu0[s]) / args.pulls * 1e3 for s in SIDES}
            daemons.check_alive()
        finally:
            for p in pullers.values():
                p.close()
            for c in (prefill, *clients.values()):
                c.close()
    diff = np.array(ms["b"]) - np.array(ms["a"])
    boot = np.median(rng.choice(diff, (1000, diff.size)), axis=1)
    return {
        "pool": args.pool,
        "device": args.device,
        "blocks": args.blocks,
        "pulls_per_side": args.pulls,
        "wall_s": wall,
        "sides": {
            s: {
                "tree": str(a if s == "a" else b),
                "p50_ms": statistics.median(ms[s]),
                "p99_ms": float(np.percentile(ms[s], 99)),
                "stages_p50_ms": {k: statistics.median(v) for k, v in stages[s].items()},
                "cpu_ms_per_pull": cpu[s],
            }
            for s in SIDES
        },
        "diff_b_minus_a_ms": {
            "median": float(np.median(diff)),
            "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="a tree holding the other kvxferd package")
    ap.add_argument("--pool", default=TINY)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--pulls", type=int, default=2000, help="pulls per side and round")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--strategy", default="kernel")
    ap.add_argument("--blocks", type=int, default=BLOCKS)
    ap.add_argument("--rounds", type=int, default=1, help="runs, the trees swapped each time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    here = Path(__file__).resolve().parent.parent
    base = Path(args.base).resolve()
    if not (base / "kvxferd" / "__init__.py").is_file():
        raise SystemExit(f"--base {base}: no kvxferd package there (git archive REV kvxferd ...)")
    runs, gains = [], []
    for r in range(args.rounds):
        swapped = r % 2 == 1
        fig = measure(args, *((here, base) if swapped else (base, here)), args.seed + r)
        runs.append(fig)
        print(f"round {r + 1}: a = {'this tree' if swapped else 'base'}, b = the other")
        for s in SIDES:
            f = fig["sides"][s]
            st = ", ".join(f"{k} {v:.3f}" for k, v in f["stages_p50_ms"].items())
            print(
                f"  {s} ({f['tree']}): p50 {f['p50_ms']:.3f} ms, p99 {f['p99_ms']:.3f} ms,"
                f" decode CPU {f['cpu_ms_per_pull']:.3f} ms/pull\n    stages p50 (ms): {st}"
            )
        d = fig["diff_b_minus_a_ms"]
        gains.append(-d["median"] if swapped else d["median"])
        print(
            f"  b - a, per pair: median {d['median'] * 1e3:+.0f} us (95 % interval"
            f" {d['ci95'][0] * 1e3:+.0f} to {d['ci95'][1] * 1e3:+.0f} us), {args.pulls} pairs of"
            f" {args.blocks}-block pulls, wall {fig['wall_s']:.1f} s"
        )
    mean = sum(gains) / len(gains)
    print(
        f"this tree - base, mean of {len(gains)} round(s)' medians: {mean * 1e3:+.0f} us"
        f" ({', '.join(f'{g * 1e3:+.0f}' for g in gains)})"
    )
    if args.json:
        doc = {"base": str(base), "tree": str(here), "rounds": runs, "this_minus_base_ms": mean}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
