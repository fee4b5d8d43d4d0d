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
import sys
from pathlib import Path

from kvxferd.scenario.control_ab import HERE, SIDES, measure
from kvxferd.scenario.control_path import BLOCKS, TINY


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
    here, base = HERE, Path(args.base).resolve()
    runs, gains = [], []
    for r in range(args.rounds):
        swapped = r % 2 == 1
        a, b = (here, base) if swapped else (base, here)
        fig = measure(
            a,
            b,
            pool=args.pool,
            device=args.device,
            pulls=args.pulls,
            warmup=args.warmup,
            strategy=args.strategy,
            n=args.blocks,
            seed=args.seed + r,
        )
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
