"""Summarise py-spy collapsed stacks (``py-spy record -f raw``) of one daemon: every frame's
share of the samples (inclusive, each frame counted once per stack) and the leaf frames'
(where the sampled thread was), optionally as time per pull.

    python -m bench.spy_report spy-decode.txt [--pulls-per-s 190 --seconds 8] [--rate 2000]

``--pulls-per-s``: the pulls the daemon served per second while it was sampled (the control
path's pulls divided by its wall time), ``--seconds``: how long it was sampled (py-spy's
``-d``): each figure is then also given in µs per pull.
Recorded with ``--gil`` (bench/device/session14b.sh), the samples are the thread holding the
GIL, so the shares are of the daemon's Python time, not of the pull's latency.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def _short(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func file.py:123``."""
    name, _, where = frame.partition(" (")
    return f"{name} {where.rstrip(')').rsplit('/', 1)[-1]}"


def summarise(path: Path) -> tuple[int, collections.Counter[str], collections.Counter[str]]:
    """Total samples, and the samples per frame: inclusive and as the leaf."""
    total = 0
    inclusive: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_short(f) for f in stack.split(";")[1:]]  # the first is the thread
        for f in set(frames):
            inclusive[f] += n
        if frames:
            leaf[frames[-1]] += n
    return total, inclusive, leaf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stacks", type=Path)
    ap.add_argument("--rate", type=float, default=2000.0, help="py-spy's samples per second")
    ap.add_argument("--pulls-per-s", type=float, default=0.0)
    ap.add_argument("--seconds", type=float, default=0.0, help="how long py-spy sampled")
    ap.add_argument("--top", type=int, default=50)
    args = ap.parse_args(argv)
    total, inclusive, leaf = summarise(args.stacks)
    pulls = args.pulls_per_s * args.seconds  # pulls served while sampled
    per_pull = 1e6 / args.rate / pulls if pulls > 0 else 0.0
    print(f"{total} samples ({total / args.rate:.2f} s at {args.rate:g} Hz)")
    for title, counts in (("inclusive", inclusive), ("leaf", leaf)):
        print(f"\n-- {title}: samples, share{', us per pull' if per_pull else ''}")
        for frame, n in counts.most_common(args.top):
            extra = f" {n * per_pull:7.1f}" if per_pull else ""
            print(f"{n:7d} {100 * n / max(total, 1):5.1f}%{extra}  {frame[:140]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
