"""Idle CPU of two real daemons (``kvxferd serve``, prefill and decode), before any pull and
after some: busy polling (``server.busy_poll``, kvxferd/busypoll.py) must leave an idle daemon
asleep once its window has passed. Prints each daemon's CPU share of one core while idle.

    python -m bench.idle_daemons [--device cuda] [--seconds 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvxferd.scenario.control_path import (
    TINY,
    cpu_seconds,
    decode_daemon,
    pool_blocks,
    prefill_daemon,
    pulling_pair,
    random_ids,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args(argv)
    opts = [prefill_daemon(TINY, args.device), decode_daemon("decode", TINY, args.device, "auto")]
    with pulling_pair(opts) as (ds, puller):
        pre, dec = ds["prefill"].ready, ds["decode"].ready
        assert pre is not None and dec is not None
        pids = {"prefill": pre.pid, "decode": dec.pid}

        def idle(label: str) -> None:
            time.sleep(1.0)  # past any busy-poll window
            before = {k: cpu_seconds(p) for k, p in pids.items()}
            time.sleep(args.seconds)
            share = {k: (cpu_seconds(p) - before[k]) / args.seconds for k, p in pids.items()}
            print(f"{label}: " + ", ".join(f"{k} {v:.1%} of a core" for k, v in share.items()))

        idle("idle after start")
        rng, blocks = np.random.default_rng(0), pool_blocks(TINY)
        for _ in range(200):
            puller.pull(random_ids(rng, blocks, 16), random_ids(rng, blocks, 16), socket=True)
        idle("idle after 200 pulls")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
