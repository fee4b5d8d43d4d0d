"""The daemons' own cost per pull, through real daemons: pulls on the scheduler socket, one at a
time, with each daemon's CPU time per pull (``bench/control_path.py`` is its command line).

A prefill and a decode daemon (``kvxferd serve``, the same-host Peer socket between them) and a
client that holds random blocks on the prefill daemon, pulls them with StartPull and ``wait``
on the decode daemon's scheduler socket, then waits for the prefill daemon to release them
(untimed), as ``kvxferd bench``'s latency rows do but with only that one way of waiting.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvxferd.scenario.client import DaemonClient
from kvxferd.scenario.daemons import DaemonOptions, DaemonSet
from kvxferd.scenario.mix import Int64Array
from kvxferd.scenario.puller import PULL_DEADLINE_MS, DaemonPuller

BLOCKS = 16
TINY = "dense:num_blocks=80,num_kv_heads=1,head_size=8"


def stat_cpu_seconds(path: str) -> float:
    """User plus system CPU time so far from a ``/proc`` stat file (a process's or a thread's)."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of every thread of ``pid`` so far."""
    return stat_cpu_seconds(f"/proc/{pid}/stat")


def pool_blocks(pool: str) -> int:
    for part in pool.split(":", 1)[-1].split(","):
        key, _, value = part.partition("=")
        if key.strip() == "num_blocks":
            return int(value)
    raise SystemExit(f"--pool {pool!r} must name num_blocks (the random IDs are drawn from it)")


def checked_blocks(pool: str, n: int) -> int:
    """The pool's logical blocks, after checking that a pull of ``n`` distinct blocks fits."""
    blocks = pool_blocks(pool)
    if not 0 < n <= blocks:
        raise SystemExit(f"--blocks {n}: pick 1 to {blocks}, the pool's num_blocks")
    return blocks


def prefill_daemon(pool: str, device: str) -> DaemonOptions:
    """The owner: leases as long as a pull's deadline."""
    extra = ("--set", f"transfer.default_deadline_ms={PULL_DEADLINE_MS}")
    return DaemonOptions("prefill", pool, device=device, extra=extra)


def decode_daemon(name: str, pool: str, device: str, strategy: str) -> DaemonOptions:
    """A reader with ``transfer.strategy`` and the scheduler socket the pulls arrive on."""
    extra = ("--set", f"transfer.strategy={strategy}")
    return DaemonOptions(name, pool, device=device, extra=extra, scheduler_socket=True)


def random_ids(rng: np.random.Generator, blocks: int, n: int) -> Int64Array:
    """``n`` distinct block IDs below ``blocks``."""
    out: Int64Array = rng.choice(blocks, n, replace=False).astype(np.int64)
    return out


def id_source(
    rng: np.random.Generator, blocks: int, n: int, distinct: int = 0
) -> Callable[[], Int64Array]:
    """Each call: the next side's ``n`` random IDs of ``blocks`` (a pull draws two, local then
    remote); with ``distinct`` > 0 the same ``distinct`` pairs, drawn once, in turn."""
    if distinct <= 0:
        return lambda: random_ids(rng, blocks, n)
    drawn = [random_ids(rng, blocks, n) for _ in range(2 * distinct)]
    turn = itertools.cycle(drawn)
    return lambda: next(turn)


@contextlib.contextmanager
def pulling_pair(options: list[DaemonOptions]) -> Iterator[tuple[DaemonSet, DaemonPuller]]:
    """Two real daemons, ``prefill`` and ``decode`` (the one with the scheduler socket), started
    and ready in a temporary directory, and a puller between them; all closed on the way out."""
    with (
        tempfile.TemporaryDirectory(prefix="kvx-control-") as workdir,
        DaemonSet(Path(workdir), options) as daemons,
    ):
        daemons.start()
        daemons.wait_ready()
        pre, dec = daemons["prefill"].ready, daemons["decode"].ready
        assert pre is not None and dec is not None
        prefill = DaemonClient("prefill", pre.grpc, pre.engine_socket)
        decode = DaemonClient(
            "decode", dec.grpc, dec.engine_socket, scheduler_socket=dec.scheduler_socket
        )
        puller = DaemonPuller(prefill, decode)
        try:
            yield daemons, puller
        finally:
            puller.close()
            prefill.close()
            decode.close()


def measure(
    pool: str,
    device: str,
    pulls: int,
    warmup: int,
    *,
    strategy: str,
    n: int = BLOCKS,
    gap_s: float = 0.0,
    distinct: int = 0,
) -> dict[str, Any]:
    """``pulls`` pulls of ``n`` random blocks after ``warmup`` untimed ones; ``gap_s``: the
    daemons are left idle that long after each pull's release (a pull after a quiet spell);
    ``distinct``: when > 0, the pulls cycle through that many block-ID lists drawn once (each
    side's), so that a study can tell the host work of a pull it has seen before from a new
    one's (bench/memo_hook)."""
    blocks = checked_blocks(pool, n)
    options = [prefill_daemon(pool, device), decode_daemon("decode", pool, device, strategy)]
    ids = id_source(np.random.default_rng(0), blocks, n, distinct)

    with pulling_pair(options) as (daemons, puller):
        pre, dec = daemons["prefill"].ready, daemons["decode"].ready
        assert pre is not None and dec is not None
        for _ in range(warmup):
            puller.pull(ids(), ids(), socket=True)
        cpu0 = {"decode": cpu_seconds(dec.pid), "prefill": cpu_seconds(pre.pid)}
        ms: list[float] = []
        release_ms: list[float] = []
        stages: dict[str, list[float]] = {}
        strategies: set[int] = set()
        t0 = time.perf_counter()
        for _ in range(pulls):
            if gap_s > 0:
                time.sleep(gap_s)
            out = puller.pull(ids(), ids(), socket=True)
            ms.append(out.seconds * 1e3)
            if not math.isnan(out.release_seconds):  # NaN: the WatchReleases stream failed
                release_ms.append(out.release_seconds * 1e3)
            strategies.add(out.status.strategy)
            for st in out.status.stages:
                stages.setdefault(st.name, []).append(st.seconds * 1e3)
        wall = time.perf_counter() - t0
        cpu = {
            "decode": cpu_seconds(dec.pid) - cpu0["decode"],
            "prefill": cpu_seconds(pre.pid) - cpu0["prefill"],
        }
        daemons.check_alive()
    return {
        "pool": pool,
        "device": device,
        "strategy": strategy,
        "strategies_seen": sorted(strategies),
        "pulls": pulls,
        "blocks": n,
        "gap_s": gap_s,
        "distinct": distinct,
        "wall_s": wall,
        "ms": ms,  # every timed pull, in order
        "p50_ms": statistics.median(ms),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "stages_p50_ms": {k: statistics.median(v) for k, v in stages.items()},
        # The pull's answer -> its release seen on WatchReleases (the blocks held meanwhile).
        "release_p50_ms": statistics.median(release_ms) if release_ms else math.nan,
        "release_p99_ms": float(np.percentile(release_ms, 99)) if release_ms else math.nan,
        "cpu_ms_per_pull": {k: v / pulls * 1e3 for k, v in cpu.items()},
    }


__all__ = [
    "BLOCKS",
    "TINY",
    "checked_blocks",
    "cpu_seconds",
    "decode_daemon",
    "id_source",
    "measure",
    "pool_blocks",
    "prefill_daemon",
    "pulling_pair",
    "random_ids",
    "stat_cpu_seconds",
]
