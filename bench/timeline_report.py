"""Print where a pull's time goes on the decode daemon (and the owner's, ``owner:``), from
``bench/timeline_hook`` stamps: one window per pull, each step's p50 and p90 offset from the
window's start, in the order of their p50s.

By default a window runs from a StartPull frame's arrival on the scheduler socket to the next
(``bench.control_path``'s pulls, one at a time). ``--cut start_pull>`` cuts at the reader's
``start_pull`` instead, which also counts pulls that came over gRPC (``kvxferd bench``'s size
rows); ``--min-ms`` keeps only the windows whose pull took at least that long from the cut to
its ``mark:publish`` (the bench's 1 GiB pulls, not its 16-block latency pulls):

    python -m bench.timeline_report DIR [--skip N]
    python -m bench.timeline_report DIR --cut 'start_pull>' --skip 1 --min-ms 1
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

import numpy as np

Stamps = list[tuple[str, float]]


def windows(stamps: Stamps, cut: str = "") -> list[Stamps]:
    """The stamps cut at each ``cut`` step, or (no ``cut``) at each StartPull's frame: the
    ``frame_in>`` just before a ``StartPull>``, each frame starting at most one window."""
    starts: list[int] = []
    last_in = -1
    for i, (name, _) in enumerate(stamps):
        if cut:
            if name == cut:
                starts.append(i)
        elif name == "frame_in>":
            last_in = i
        elif name == "StartPull>" and last_in >= 0:
            starts.append(last_in)
            last_in = -1
    ends = [*starts[1:], len(stamps)]
    return [stamps[s:e] for s, e in zip(starts, ends, strict=True)]


def pull_ms(window: Stamps) -> float:
    """From the window's start to its pull's ``mark:publish`` (inf when it has none)."""
    for name, t in window:
        if name == "mark:publish":
            return (t - window[0][1]) * 1e3
    return float("inf")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--skip", type=int, default=200, help="pulls to skip (warm-up)")
    ap.add_argument("--cut", default="", help="start each window at this step (default: frame)")
    ap.add_argument("--min-ms", type=float, default=0.0, help="only pulls at least this long")
    ap.add_argument("--each", default="", help="also list, pull by pull, the steps matching this")
    args = ap.parse_args(argv)
    (path,) = Path(args.dir).glob("timeline-decode-*.json")
    stamps = [(str(n), float(t)) for n, t in json.loads(path.read_text())]
    for owner in Path(args.dir).glob("timeline-owner-*.json"):  # one clock on one host
        stamps += [(f"owner:{n}", float(t)) for n, t in json.loads(owner.read_text())]
    stamps.sort(key=lambda s: s[1])
    offsets: dict[str, list[float]] = {}
    wins = [
        w
        for w in windows(stamps, args.cut)[args.skip : -1]
        if args.min_ms <= 0 or args.min_ms <= pull_ms(w) < float("inf")
    ]
    for w in wins:
        t0 = w[0][1]
        seen: dict[str, int] = {}
        for name, t in w:
            k = seen.get(name, 0)
            seen[name] = k + 1
            offsets.setdefault(name if k == 0 else f"{name}#{k + 1}", []).append((t - t0) * 1e6)
    rows = [
        (statistics.median(v), float(np.percentile(v, 90)), len(v), n)
        for n, v in offsets.items()
        if len(v) >= len(wins) // 2
    ]
    print(f"{len(wins)} pulls; offsets from {args.cut or 'the StartPull frame arrival'}, us")
    print(f"{'step':32} {'p50':>8} {'p90':>8} {'n':>6}")
    for p50, p90, n, name in sorted(rows):
        print(f"{name:32} {p50:8.1f} {p90:8.1f} {n:6d}")
    if args.each:
        pick = re.compile(args.each)
        print(f"\npull by pull, offsets (us) of the steps matching {args.each!r}:")
        for i, w in enumerate(wins):
            t0 = w[0][1]
            steps = [f"{name} {(t - t0) * 1e6:.0f}" for name, t in w if pick.search(name)]
            print(f"{i:4d} {pull_ms(w):7.3f} ms: " + ", ".join(steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
