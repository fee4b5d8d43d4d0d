"""What an idle spell costs the next piece of work on this host, and whether a CPU wake-up
latency request (Linux PM QoS, ``/dev/cpu_dma_latency``) takes the cost away.

A study, not a tool. ``measure`` times one 16-block ``plan_pull`` (pure Python and NumPy, ~25
µs warm) right after the thread slept for each of several gaps, and after it spun for the
longest gap instead; ``--qos US`` holds a wake-up latency request of US µs for the run (0: the
CPUs never leave their polling idle state). ``hold`` runs a command while such a request is
held, to time anything (``bench.control_path``, ``kvxferd bench``) with and without it:

    python -m bench.studies.idle_wake measure [--qos 0]
    python -m bench.studies.idle_wake hold 0 -- python -m bench.control_path --gap-ms 20

The request is the kernel's (tuned's ``latency-performance`` profile makes the same): it lasts
while the file stays open, and it needs root or write access to the device. On the H200 VM it
changed nothing (docs/benchmarks.md, "Session 26"), so the daemon does not make it.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import struct
import subprocess
import sys
import time

import numpy as np

from kvxferd.blocks import plan_pull
from kvxferd.layout.presets import preset

GAPS_MS = (0.0, 0.5, 2.0, 10.0, 50.0)
PM_QOS_DEVICE = "/dev/cpu_dma_latency"


def request(us: int) -> int:
    """Hold a wake-up latency request of ``us`` µs: the open file (closing it ends it)."""
    fd = os.open(PM_QOS_DEVICE, os.O_WRONLY | os.O_CLOEXEC)
    os.write(fd, struct.pack("=i", us))  # the device takes a native 32-bit integer
    return fd


def measure(calls: int) -> list[tuple[str, float]]:
    """p50 µs of one plan after each gap (slept), and after the longest gap spent spinning."""
    spec = preset("dense:num_blocks=600")
    rng = random.Random(1)

    def one() -> float:
        local = np.array(rng.sample(range(600), 16), dtype=np.int64)
        remote = np.array(rng.sample(range(600), 16), dtype=np.int64)
        t = time.perf_counter()
        plan_pull(spec, spec, [local], [remote], prefix_caching=True)
        return time.perf_counter() - t

    for _ in range(500):
        one()
    rows = []
    for gap in GAPS_MS:
        xs = []
        for _ in range(calls):
            if gap:
                time.sleep(gap / 1e3)
            xs.append(one())
        rows.append((f"after {gap:g} ms asleep", statistics.median(xs) * 1e6))
    xs = []
    for _ in range(calls):
        until = time.perf_counter() + GAPS_MS[-1] / 1e3
        while time.perf_counter() < until:
            pass
        xs.append(one())
    rows.append((f"after {GAPS_MS[-1]:g} ms spinning", statistics.median(xs) * 1e6))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="time a plan after idle gaps")
    m.add_argument("--qos", type=int, default=-1, help="hold a wake-up latency request (µs)")
    m.add_argument("--calls", type=int, default=100)
    h = sub.add_parser("hold", help="run a command while a wake-up latency request is held")
    h.add_argument("us", type=int)
    h.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    us = args.qos if args.cmd == "measure" else args.us
    try:
        fd = request(us) if us >= 0 else -1
    except OSError as err:
        print(f"no wake-up latency request: {PM_QOS_DEVICE}: {err.strerror}", file=sys.stderr)
        return 1
    try:
        if args.cmd == "hold":
            cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
            return subprocess.run(cmd, check=False).returncode
        label = f"a {us} µs wake-up latency request held" if fd >= 0 else "no request"
        print(f"one 16-block plan_pull, p50 of {args.calls} ({label}):")
        for name, us_p50 in measure(args.calls):
            print(f"  {name:26} {us_p50:7.1f} µs")
        return 0
    finally:
        if fd >= 0:
            os.close(fd)


if __name__ == "__main__":
    raise SystemExit(main())
