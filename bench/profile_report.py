"""Summarise a daemon's cProfile stats (bench/profile_hook) per pull: the kvxferd functions by
cumulative time per pull, then every function by own time per pull.

    python -m bench.profile_report /tmp/prof/decode-1234.prof [--pulls N] [--top 60]

``--pulls``: how many pulls the profile covers, the divisor of every figure; by default the
calls of ``plan_pull`` (once per pull on a reader) in the profile. One-time work (start-up, a
kernel's first launch) is averaged into it unless the profile started late
(``KVX_PROFILE_AFTER_S``). Times are cProfile's (inflated by its own overhead, so read them as a
ranking and as shares of a pull, not as the daemon's latency).
"""

from __future__ import annotations

import argparse
import pstats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stats")
    ap.add_argument("--pulls", type=int, default=0, help="default: plan_pull's calls")
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--min-calls", type=float, default=0.9, help="calls per pull to list")
    args = ap.parse_args(argv)
    raw = pstats.Stats(args.stats).stats  # type: ignore[attr-defined]
    n = args.pulls or sum(
        calls for (_, _, name), (_, calls, *_) in raw.items() if name == "plan_pull"
    )
    if not n:
        ap.error("no plan_pull call in the profile: pass --pulls")
    rows = []
    for (path, line, name), (_, calls, own, cum, _) in raw.items():
        if calls / n < args.min_calls:
            continue
        where = f"{path.split('kvxferd/')[-1] if 'kvxferd/' in path else path}:{line} {name}"
        rows.append((cum / n * 1e6, own / n * 1e6, calls / n, where, "kvxferd/" in path))
    print(f"per pull ({n} pulls): cumulative us, own us, calls; kvxferd functions")
    for cum, own, calls, where, ours in sorted(rows, reverse=True):
        if ours and cum > 0:
            print(f"{cum:9.1f} {own:8.1f} {calls:6.1f}  {where}")
            args.top -= 1
            if args.top <= 0:
                break
    print("\nown time per pull, every function (top 40)")
    for cum, own, calls, where, _ in sorted(rows, key=lambda r: -r[1])[:40]:
        print(f"{own:8.1f} {cum:9.1f} {calls:6.1f}  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
