"""Pulls of an engine-attached pool against pulls of a daemon-owned pool, in one run (issue 7).

Run from the repository root::

    python -m bench.attached_pull --device cuda --json attached.json   # GPU (cuda:0 -> cuda:1)
    python -m bench.attached_pull                                       # host memory

Three real daemons: ``owned`` (allocates its pool, fills the pattern), ``attached``
(``pool.mode = attached``: this process plays the engine, attaches OWNED, so the daemon allocates
and exports, and writes the same pattern through its mapped tensors) and ``decode``. The same
requests (1 GiB by default: 512 blocks of a 32-layer dense cache, contiguous and random block
IDs) are pulled from each prefill daemon in turn, interleaved, and timed from StartPull to the
terminal status on the watch stream. Sampled blocks are verified with Checksum after every
source's first pull: the bytes the engine wrote are the bytes the decode daemon holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvxferd.engine import EngineClient
from kvxferd.pool import KVPool
from kvxferd.scenario.client import DaemonClient
from kvxferd.scenario.daemons import DaemonOptions, DaemonSet
from kvxferd.scenario.puller import DaemonPuller

SEED = 7


def _client(ds: DaemonSet, name: str) -> DaemonClient:
    r = ds[name].ready
    assert r is not None
    return DaemonClient(name, r.grpc, r.engine_socket)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--blocks", type=int, default=512, help="blocks per request (512 = 1 GiB)")
    ap.add_argument("--pool-blocks", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    if args.device == "cuda":
        import torch

        dev_p = "cuda:0"
        dev_d = "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0"
    else:
        dev_p = dev_d = "cpu"
    pool = f"dense:num_blocks={args.pool_blocks}"
    workdir = Path(tempfile.mkdtemp(prefix="kvxferd-attached-"))
    options = [
        DaemonOptions("owned", pool, device=dev_p, fill_seed=SEED),
        DaemonOptions("attached", pool, device=dev_p, extra=("--set", "pool.mode=attached")),
        DaemonOptions("decode", pool, device=dev_d),
    ]
    rows: list[dict[str, Any]] = []
    with DaemonSet(workdir, options) as ds:
        ds.start()
        ds.wait_ready()
        owned, attached, decode = (_client(ds, n) for n in ("owned", "attached", "decode"))
        r = ds["attached"].ready
        assert r is not None
        engine = EngineClient(r.engine_socket)
        att = engine.attach(pool, "owned", dev_p)
        t0 = time.perf_counter()
        kv = KVPool(att.spec, att.tensors)  # the engine's view: tensors on the daemon's memory
        kv.fill_pattern(0, range(att.spec.num_kernel_blocks(0)), SEED)
        if dev_p.startswith("cuda"):
            import torch

            torch.cuda.synchronize()
        print(f"engine attached ({att.mode}) and wrote the pool in {time.perf_counter() - t0:.1f}s")
        pullers = {"owned": DaemonPuller(owned, decode), "attached": DaemonPuller(attached, decode)}
        rng = np.random.default_rng(SEED)
        n = args.blocks
        for p in pullers.values():  # handshakes and connections
            p.pull(np.arange(16, dtype=np.int64), np.arange(16, dtype=np.int64))
        for pattern in ("contiguous", "random"):
            secs: dict[str, list[float]] = {k: [] for k in pullers}
            nbytes = 0
            for rep in range(args.repeat):
                if pattern == "contiguous":
                    lo = int(rng.integers(0, args.pool_blocks - n + 1))
                    local = remote = np.arange(lo, lo + n, dtype=np.int64)
                else:
                    local = rng.choice(args.pool_blocks, n, replace=False).astype(np.int64)
                    remote = rng.choice(args.pool_blocks, n, replace=False).astype(np.int64)
                for name, p in pullers.items():
                    out = p.pull(local, remote)
                    secs[name].append(out.seconds)
                    nbytes = out.status.nbytes
                    if rep == 0:
                        bad = p.verify(local, remote, SEED + rep)
                        if bad:
                            raise SystemExit(f"{name} {pattern}: {bad} sampled blocks differ")
            gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in secs.items()}
            ratio = gbps["attached"] / gbps["owned"]
            rows.append(
                {
                    "pattern": pattern,
                    "bytes": nbytes,
                    "owned_gbps": round(gbps["owned"], 2),
                    "attached_gbps": round(gbps["attached"], 2),
                    "attached_over_owned": round(ratio, 3),
                    "repeat": args.repeat,
                    "prefill": dev_p,
                    "decode": dev_d,
                }
            )
        for p in pullers.values():
            p.close()
        att.detach()
        engine.close()
    print(f"\n{'pattern':11} {'bytes':>12} {'owned GB/s':>11} {'attached GB/s':>14} {'ratio':>6}")
    for row in rows:
        print(
            f"{row['pattern']:11} {row['bytes']:>12} {row['owned_gbps']:>11.2f}"
            f" {row['attached_gbps']:>14.2f} {row['attached_over_owned']:>6.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
