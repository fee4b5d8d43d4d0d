"""Print where a pull's time goes on the decode daemon (and the owner's, ``owner:``), from
``bench/timeline_hook`` stamps: one window per StartPull (from the frame's arrival to the next
StartPull's), each step's p50 and p90 offset from the window's start, in the order of their
p50s.

    python -m bench.timeline_report DIR [--skip N]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np


def windows(stamps: list[tuple[str, float]]) -> list[list[tuple[str, float]]]:
    """The stamps cut at each StartPull's frame (the ``frame_in>`` just before it)."""
    starts: list[int] = []
    last_in = -1
    for i, (name, _) in enumerate(stamps):
        if name == "frame_in>":
            last_in = i
        elif name == "StartPull>" and last_in >= 0:
            starts.append(last_in)
    ends = [*starts[1:], len(stamps)]
    return [stamps[s:e] for s, e in zip(starts, ends, strict=True)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--skip", type=int, default=200, help="pulls to skip (warm-up)")
    args = ap.parse_args(argv)
    (path,) = Path(args.dir).glob("timeline-decode-*.json")
    stamps = [(str(n), float(t)) for n, t in json.loads(path.read_text())]
    for owner in Path(args.dir).glob("timeline-owner-*.json"):  # one clock on one host
        stamps += [(f"owner:{n}", float(t)) for n, t in json.loads(owner.read_text())]
    stamps.sort(key=lambda s: s[1])
    offsets: dict[str, list[float]] = {}
    wins = windows(stamps)[args.skip : -1]
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
    print(f"{len(wins)} pulls; offsets from the StartPull frame's arrival, us")
    print(f"{'step':32} {'p50':>8} {'p90':>8} {'n':>6}")
    for p50, p90, n, name in sorted(rows):
        print(f"{name:32} {p50:8.1f} {p90:8.1f} {n:6d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
