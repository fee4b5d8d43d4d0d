"""Pulls of engine-attached pools against pulls of a daemon-owned pool, in one run (issues 7, 13).

Run from the repository root::

    python -m bench.attached_pull --device cuda --json attached.json   # GPU (cuda:0 -> cuda:1)
    python -m bench.attached_pull                                       # host memory

Real daemons, one per source, and a ``decode`` daemon that pulls from each:

* ``owned``: allocates its pool and fills the pattern itself;
* ``attached``: ``pool.mode = attached``; this process plays the engine and attaches OWNED (the
  daemon allocates and exports, the engine writes the pattern through its mapped tensors);
* ``imported``: ``pool.mode = attached``; this process allocates the pool itself (on a GPU: plain
  torch CUDA tensors, as an engine's KV cache) and attaches it IMPORTED. On a GPU the daemon
  serves it with KERNEL pulls only (docs/attachment.md), so with ``--device cuda`` the decode
  daemon's pulls of every source are KERNEL (same host): the comparison is owned vs imported
  memory under one strategy.

The same requests (1 GiB by default: 512 blocks of a 32-layer dense cache, contiguous and random
block IDs) are pulled from each source in turn, interleaved, and timed from StartPull to the
terminal status on the watch stream (median of ``--repeat``); then ``--latency-pulls`` pulls of
16 random blocks per source, interleaved, give the small-request latency (p50, p99). Sampled
blocks are verified with Checksum after every source's first pull of each pattern: the bytes
the engine wrote are the bytes the decode daemon holds.
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
import torch

from kvxferd.engine import Attachment, EngineClient, shared_tensors
from kvxferd.layout.presets import preset
from kvxferd.pool import KVPool
from kvxferd.scenario.client import DaemonClient
from kvxferd.scenario.daemons import DaemonOptions, DaemonSet
from kvxferd.scenario.puller import DaemonPuller, PullOutcome
from kvxferd.v1 import scheduler_pb2

SEED = 7
SOURCES = ("owned", "attached", "imported")
SMALL_BLOCKS = 16


def _client(ds: DaemonSet, name: str) -> DaemonClient:
    r = ds[name].ready
    assert r is not None
    return DaemonClient(name, r.grpc, r.engine_socket)


def _attach(ds: DaemonSet, name: str, pool: str, device: str) -> tuple[EngineClient, Attachment]:
    """This process as the engine of daemon ``name``: attach (OWNED, or IMPORTED with tensors
    it allocates itself) and write the pattern into the pool."""
    r = ds[name].ready
    assert r is not None
    engine = EngineClient(r.engine_socket)
    t0 = time.perf_counter()
    if name == "imported":
        tensors = shared_tensors(preset(pool), device)
        att = engine.attach(pool, "imported", device, tensors=tensors)
    else:
        att = engine.attach(pool, "owned", device)
    kv = KVPool(att.spec, att.tensors)  # the engine's view of the pool
    kv.fill_pattern(0, range(att.spec.num_kernel_blocks(0)), SEED)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    took = time.perf_counter() - t0
    print(f"{name}: engine attached ({att.mode}) and wrote the pool in {took:.1f}s")
    return engine, att


def _strategy(out: PullOutcome) -> str:
    name = scheduler_pb2.TransferStrategy.Name(out.status.strategy)
    return name.removeprefix("TRANSFER_STRATEGY_")


def _throughput(
    pullers: dict[str, DaemonPuller], args: argparse.Namespace, devices: tuple[str, str]
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(SEED)
    n, rows = args.blocks, []
    for pattern in ("contiguous", "random"):
        secs: dict[str, list[float]] = {k: [] for k in pullers}
        strategies: dict[str, set[str]] = {k: set() for k in pullers}
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
                strategies[name].add(_strategy(out))
                nbytes = out.status.nbytes
                if rep == 0:
                    bad = p.verify(local, remote, SEED + rep)
                    if bad:
                        raise SystemExit(f"{name} {pattern}: {bad} sampled blocks differ")
        for name in pullers:
            gbps = nbytes / statistics.median(secs[name]) / 1e9
            owned = nbytes / statistics.median(secs["owned"]) / 1e9 if "owned" in secs else gbps
            rows.append(
                {
                    "kind": "throughput",
                    "pattern": pattern,
                    "source": name,
                    "strategy": ",".join(sorted(strategies[name])),
                    "bytes": nbytes,
                    "gbps": round(gbps, 2),
                    "over_owned": round(gbps / owned, 3),
                    "repeat": args.repeat,
                    "prefill": devices[0],
                    "decode": devices[1],
                }
            )
    return rows


def _latency(
    pullers: dict[str, DaemonPuller], args: argparse.Namespace, devices: tuple[str, str]
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(SEED + 1)
    secs: dict[str, list[float]] = {k: [] for k in pullers}
    server: dict[str, list[float]] = {k: [] for k in pullers}
    strategies: dict[str, set[str]] = {k: set() for k in pullers}
    nbytes = 0
    for _ in range(args.latency_pulls):
        local = rng.choice(args.pool_blocks, SMALL_BLOCKS, replace=False).astype(np.int64)
        remote = rng.choice(args.pool_blocks, SMALL_BLOCKS, replace=False).astype(np.int64)
        for name, p in pullers.items():
            out = p.pull(local, remote)
            secs[name].append(out.seconds)
            server[name].append(out.server_seconds)
            strategies[name].add(_strategy(out))
            nbytes = out.status.nbytes
    rows = []
    for name in pullers:
        ms = np.array(secs[name]) * 1e3
        rows.append(
            {
                "kind": "latency",
                "pattern": f"{SMALL_BLOCKS} random blocks",
                "source": name,
                "strategy": ",".join(sorted(strategies[name])),
                "bytes": nbytes,
                "p50_ms": round(float(np.percentile(ms, 50)), 3),
                "p99_ms": round(float(np.percentile(ms, 99)), 3),
                "daemon_p50_ms": round(float(np.median(server[name])) * 1e3, 3),
                "pulls": args.latency_pulls,
                "prefill": devices[0],
                "decode": devices[1],
            }
        )
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'pattern':18} {'source':9} {'strategy':9} {'bytes':>11} {'GB/s':>8} {'x owned':>8}")
    for r in (r for r in rows if r["kind"] == "throughput"):
        print(
            f"{r['pattern']:18} {r['source']:9} {r['strategy']:9} {r['bytes']:>11}"
            f" {r['gbps']:>8.2f} {r['over_owned']:>8.3f}"
        )
    print(f"\n{'latency':18} {'source':9} {'strategy':9} {'bytes':>11} {'p50 ms':>8} {'p99 ms':>8}")
    for r in (r for r in rows if r["kind"] == "latency"):
        print(
            f"{r['pattern']:18} {r['source']:9} {r['strategy']:9} {r['bytes']:>11}"
            f" {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f}  (daemon p50 {r['daemon_p50_ms']:.3f})"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--blocks", type=int, default=512, help="blocks per request (512 = 1 GiB)")
    ap.add_argument("--pool-blocks", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--latency-pulls", type=int, default=200, help="16-block pulls per source")
    ap.add_argument(
        "--sources",
        default=",".join(SOURCES),
        help=f"comma-separated, from {','.join(SOURCES)} (owned is the reference)",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    sources = [s for s in args.sources.split(",") if s]
    if not set(sources) <= set(SOURCES) or "owned" not in sources:
        ap.error(f"--sources: pick from {','.join(SOURCES)}, owned included")

    if args.device == "cuda":
        dev_p = "cuda:0"
        dev_d = "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0"
    else:
        dev_p = dev_d = "cpu"
    pool = f"dense:num_blocks={args.pool_blocks}"
    workdir = Path(tempfile.mkdtemp(prefix="kvxferd-attached-"))
    attached = ("--set", "pool.mode=attached")
    options = [
        DaemonOptions(name, pool, device=dev_p, fill_seed=SEED)
        if name == "owned"
        else DaemonOptions(name, pool, device=dev_p, extra=attached)
        for name in sources
    ]
    options.append(DaemonOptions("decode", pool, device=dev_d))
    rows: list[dict[str, Any]] = []
    with DaemonSet(workdir, options) as ds:
        ds.start()
        ds.wait_ready()
        decode = _client(ds, "decode")
        engines = [_attach(ds, name, pool, dev_p) for name in sources if name != "owned"]
        pullers = {name: DaemonPuller(_client(ds, name), decode) for name in sources}
        for p in pullers.values():  # handshakes, connections, mappings
            p.pull(np.arange(16, dtype=np.int64), np.arange(16, dtype=np.int64))
        rows += _throughput(pullers, args, (dev_p, dev_d))
        if args.latency_pulls:
            rows += _latency(pullers, args, (dev_p, dev_d))
        for p in pullers.values():
            p.close()
        for engine, att in engines:
            att.detach()
            engine.close()
    _print(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
