"""Two decode daemons, one prefill daemon, pulls alternating between them: an A/B of the decode
daemon's cost per pull that the machine's drift cannot tilt (``bench/control_ab.py`` is its
command line).

One prefill daemon serves two decode daemons, ``a`` and ``b``, each importing the ``kvxferd``
package of its own tree (a ``git archive`` of another commit, or this checkout): the tree first
on ``PYTHONPATH`` and the working directory kept off ``sys.path`` (``PYTHONSAFEPATH``; ``-m``
would put it first). Each pair of pulls goes to both, in a random order, on the same machine
state. The figures: each side's p50 / p99, its stage p50s and its decode daemon's CPU per pull,
and the median of the per-pair differences (b - a) with a bootstrap 95 % interval. The interval
covers the pairs of one run only: the slot a daemon runs in can favour it (on the 2-core VM by
up to 40 µs in an A/A run), which swapping the trees between runs cancels.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvxferd.scenario.client import DaemonClient
from kvxferd.scenario.control_path import (
    BLOCKS,
    TINY,
    checked_blocks,
    cpu_seconds,
    decode_daemon,
    prefill_daemon,
    random_ids,
)
from kvxferd.scenario.daemons import DaemonSet
from kvxferd.scenario.mix import Int64Array
from kvxferd.scenario.puller import DaemonPuller

HERE = Path(__file__).resolve().parents[2]  # this checkout: the tree holding this kvxferd

SIDES = ("a", "b")


def tree_env(tree: Path) -> dict[str, str]:
    """The environment of a daemon that must import ``tree``'s kvxferd: first on the path, and
    the working directory kept off it (PYTHONSAFEPATH: ``-m`` would put it first)."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *rest]), "PYTHONSAFEPATH": "1"}


def measure(
    a: Path,
    b: Path,
    *,
    pool: str = TINY,
    device: str = "cpu",
    pulls: int = 2000,
    warmup: int = 200,
    strategy: str = "kernel",
    n: int = BLOCKS,
    seed: int = 0,
    here: Path = HERE,
) -> dict[str, Any]:
    """One run: decode daemon ``a`` imports the kvxferd of tree ``a``, ``b`` that of ``b``; the
    prefill daemon that of ``here``. ``pulls`` pairs, each pull of ``n`` random blocks."""
    blocks = checked_blocks(pool, n)
    for tree in (a, b):
        if not (tree / "kvxferd" / "__init__.py").is_file():
            raise SystemExit(f"{tree}: no kvxferd package there (git archive REV kvxferd ...)")
    options = [
        prefill_daemon(pool, device),
        *(decode_daemon(s, pool, device, strategy) for s in SIDES),
    ]
    rng = np.random.default_rng(seed)

    def ids() -> Int64Array:
        return random_ids(rng, blocks, n)

    with (
        tempfile.TemporaryDirectory(prefix="kvx-ab-") as workdir,
        DaemonSet(Path(workdir), options) as daemons,
    ):
        for d, tree in zip(daemons, (here, a, b), strict=True):
            d.start(tree_env(tree))
        daemons.wait_ready()
        ready = {d.name: d.ready for d in daemons}
        pre = ready["prefill"]
        assert pre is not None
        prefill = DaemonClient("prefill", pre.grpc, pre.engine_socket)
        clients, pullers = {}, {}
        for s in SIDES:
            r = ready[s]
            assert r is not None
            clients[s] = DaemonClient(
                s, r.grpc, r.engine_socket, scheduler_socket=r.scheduler_socket
            )
            pullers[s] = DaemonPuller(prefill, clients[s])
        ms: dict[str, list[float]] = {s: [] for s in SIDES}
        stages: dict[str, dict[str, list[float]]] = {s: {} for s in SIDES}
        try:
            for _ in range(warmup):
                for s in SIDES:
                    pullers[s].pull(ids(), ids(), socket=True)
            pids = {s: r.pid for s, r in ready.items() if r is not None}
            cpu0 = {s: cpu_seconds(pids[s]) for s in SIDES}
            t0 = time.perf_counter()
            for _ in range(pulls):
                for s in SIDES if rng.random() < 0.5 else SIDES[::-1]:
                    out = pullers[s].pull(ids(), ids(), socket=True)
                    ms[s].append(out.seconds * 1e3)
                    for st in out.status.stages:
                        stages[s].setdefault(st.name, []).append(st.seconds * 1e3)
            wall = time.perf_counter() - t0
            cpu = {s: (cpu_seconds(pids[s]) - cpu0[s]) / pulls * 1e3 for s in SIDES}
            daemons.check_alive()
        finally:
            for p in pullers.values():
                p.close()
            for c in (prefill, *clients.values()):
                c.close()
    diff = np.array(ms["b"]) - np.array(ms["a"])
    boot = np.median(rng.choice(diff, (1000, diff.size)), axis=1)
    return {
        "pool": pool,
        "device": device,
        "blocks": n,
        "pulls_per_side": pulls,
        "wall_s": wall,
        "sides": {
            s: {
                "tree": str(a if s == "a" else b),
                "pid": pids[s],
                "p50_ms": statistics.median(ms[s]),
                "p99_ms": float(np.percentile(ms[s], 99)),
                "stages_p50_ms": {k: statistics.median(v) for k, v in stages[s].items()},
                "cpu_ms_per_pull": cpu[s],
            }
            for s in SIDES
        },
        "diff_b_minus_a_ms": {
            "median": float(np.median(diff)),
            "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
        },
    }


__all__ = ["HERE", "SIDES", "measure", "tree_env"]
