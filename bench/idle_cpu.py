"""Idle CPU of one NIXL agent per progress mode (the idle spin trap), from /proc/self/stat.

Run from the repository root: ``python -m bench.idle_cpu``. Each agent registers one region
and loads a live peer's metadata (a spawned owner), then sits idle for ``--seconds``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from kvxferd.nixl import AgentOptions, MemType, NixlAgent, ProgressMode
from kvxferd.scenario.control_path import cpu_seconds
from kvxferd.scenario.owner import OwnerProcess, OwnerSpec


def _cpu_s() -> float:
    return cpu_seconds(os.getpid())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args(argv)
    owner = OwnerProcess(OwnerSpec("idle-owner", (1 << 16,), fill=False))
    modes = [
        ("progress thread, delay 0 (NIXL Python default)", AgentOptions(progress_delay_us=0)),
        ("progress thread, delay 100 us (kvxferd default)", AgentOptions()),
        ("progress thread, delay 1000 us", AgentOptions(progress_delay_us=1000)),
        (
            "no progress thread, NIXL thread polls every 5 ms",
            AgentOptions(progress=ProgressMode.POLL),
        ),
        (
            "no progress thread, NIXL thread polls every 1 ms",
            AgentOptions(progress=ProgressMode.POLL, idle_poll_s=0.001),
        ),
    ]
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    try:
        for i, (label, opts) in enumerate(modes):
            agent = NixlAgent(f"idle-{i}", options=opts)
            agent.start()
            agent.register(
                np.array([[buf.data_ptr(), buf.numel(), 0]], dtype=np.int64), MemType.DRAM
            )
            agent.add_remote(owner.name, owner.metadata)
            time.sleep(0.2)
            c0, t0 = _cpu_s(), time.monotonic()
            time.sleep(args.seconds)
            share = (_cpu_s() - c0) / (time.monotonic() - t0)
            print(f"{label:52} {share * 100:6.1f} % of a core")
            agent.close()
    finally:
        owner.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
