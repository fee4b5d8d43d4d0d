"""Line up the stamps of ``bench/trace_hook`` (one decode and one owner daemon of one host):
for each lease confirmation the reader sent, when the owner's connection got it, when its
handler started and had answered, and when the answer reached the reader; and how long before
the confirmation the owner had answered the pull's Hold. Prints p50 / p90 of each step.

    python -m bench.trace_report DIR [--skip N]
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from pathlib import Path


def _after(xs: list[float], t: float) -> float | None:
    i = bisect.bisect_left(xs, t)
    return xs[i] if i < len(xs) else None


def _before(xs: list[float], t: float) -> float | None:
    i = bisect.bisect_right(xs, t) - 1
    return xs[i] if i >= 0 else None


def _sorted(stamps: dict[str, list[float]], name: str) -> list[float]:
    return sorted(stamps.get(name, []))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--skip", type=int, default=200, help="confirmations to skip (warm-up)")
    args = ap.parse_args(argv)
    files = {
        p.name.split("-")[1]: json.loads(p.read_text()) for p in Path(args.dir).glob("trace-*.json")
    }
    dec, own = files["decode"], files["owner"]
    frame_in, start, end = (
        _sorted(own, "frame_in"),
        _sorted(own, "serve_start"),
        _sorted(own, "serve_end"),
    )
    answer_in, hold_end = _sorted(dec, "answer_in"), _sorted(own, "hold_end")
    steps: dict[str, list[float]] = {}
    for sent in _sorted(dec, "sent")[args.skip :]:
        fi = _after(frame_in, sent)
        st = fi is not None and _after(start, fi)
        en = st and _after(end, st)
        ai = en and _after(answer_in, en)
        hd = _before(hold_end, sent)
        if not (fi and st and en and ai and hd):
            continue
        for name, v in (
            ("Hold answered -> confirmation sent", sent - hd),
            ("sent -> owner's connection reads it", fi - sent),
            ("read -> handler starts", st - fi),
            ("handler starts -> answer written", en - st),
            ("answer written -> reader's connection reads it", ai - en),
            ("sent -> answer read (round trip)", ai - sent),
        ):
            steps.setdefault(name, []).append(v * 1e6)
    n = len(next(iter(steps.values()), []))
    print(f"{n} confirmations (p50 / p90, us)")
    for name, vs in steps.items():
        vs.sort()
        print(f"  {name:48s} {statistics.median(vs):8.1f} {vs[int(len(vs) * 0.9)]:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
