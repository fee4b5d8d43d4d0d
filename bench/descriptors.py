"""Descriptor strategy: per-request ``initialize_xfer`` vs ``make_prepped_xfer`` on prepared
per-block lists, for requests of 16..16384 random (layer, block) descriptors of 64 KiB.

Run from the repository root: ``python -m bench.descriptors``. Reports, per request size, the
median time to create the request (descriptor lists + NIXL request), to post it, and to complete
it, for both strategies, plus the one-off cost of preparing the per-block lists (32 layers x
``--num-blocks`` entries per side). Random blocks, so neither side merges descriptors.

This is a measurement tool: it reaches the raw NIXL agent through ``NixlAgent.submit`` on the
agent's own thread; the daemon itself only uses the per-request path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvxferd.nixl import MemType, NixlAgent
from kvxferd.scenario.owner import OwnerProcess, OwnerSpec

LAYERS = 32
BLOCK = 64 << 10


def _rows(base: np.ndarray, nb: int) -> np.ndarray:
    """N x 3 descriptors of every (layer, block), layer-major."""
    blocks = np.arange(nb, dtype=np.int64) * BLOCK
    addr = (base[:, None] + blocks[None, :]).ravel()
    return np.stack([addr, np.full_like(addr, BLOCK), np.zeros_like(addr)], axis=1)


def _wait(raw: Any, h: Any) -> None:
    while raw.check_xfer_state(h) == "PROC":
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    nb = args.num_blocks
    owner = OwnerProcess(OwnerSpec("desc-owner", (nb * BLOCK,) * LAYERS, fill=False))
    agent = NixlAgent("desc-reader")
    agent.start()
    bufs = [torch.zeros(nb * BLOCK, dtype=torch.uint8) for _ in range(LAYERS)]
    regions = np.array([[b.data_ptr(), b.numel(), 0] for b in bufs], dtype=np.int64)
    agent.register(regions, MemType.DRAM)
    agent.add_remote(owner.name, owner.metadata)
    local_all = _rows(regions[:, 0], nb)
    remote_all = _rows(owner.regions[:, 0].astype(np.int64), nb)
    rng = np.random.default_rng(0)
    peer = owner.name

    def run() -> dict[str, Any]:
        raw = agent._agent  # bench only: on the NIXL thread (we are inside agent.submit)
        t0 = time.perf_counter()
        lp = raw.prep_xfer_dlist("", local_all, "DRAM")
        rp = raw.prep_xfer_dlist(peer, remote_all, "DRAM")
        prep_ms = (time.perf_counter() - t0) * 1e3
        h = raw.initialize_xfer(
            "READ",
            raw.get_xfer_descs(local_all[:1], "DRAM"),
            raw.get_xfer_descs(remote_all[:1], "DRAM"),
            peer,
        )
        raw.transfer(h)
        _wait(raw, h)
        raw.release_xfer_handle(h)  # connection warm
        out: dict[str, Any] = {"prep_ms": prep_ms, "sizes": {}}
        n = 16
        while n <= 16384:
            stats: dict[str, list[float]] = {
                k: []
                for k in (
                    "init_create",
                    "init_post",
                    "init_total",
                    "prep_create",
                    "prep_post",
                    "prep_total",
                )
            }
            for rep in range(args.repeat):
                # Fresh blocks per strategy, alternating which goes first: no cache bias.
                for kind in ("init", "prep") if rep % 2 == 0 else ("prep", "init"):
                    li = rng.choice(local_all.shape[0], n, replace=False)
                    ri = rng.choice(remote_all.shape[0], n, replace=False)
                    t0 = time.perf_counter()
                    if kind == "init":
                        h = raw.initialize_xfer(
                            "READ",
                            raw.get_xfer_descs(local_all[li], "DRAM"),
                            raw.get_xfer_descs(remote_all[ri], "DRAM"),
                            peer,
                        )
                    else:
                        h = raw.make_prepped_xfer(
                            "READ", lp, li.astype(np.int32), rp, ri.astype(np.int32)
                        )
                    t1 = time.perf_counter()
                    raw.transfer(h)
                    t2 = time.perf_counter()
                    _wait(raw, h)
                    t3 = time.perf_counter()
                    raw.release_xfer_handle(h)
                    stats[f"{kind}_create"].append((t1 - t0) * 1e3)
                    stats[f"{kind}_post"].append((t2 - t1) * 1e3)
                    stats[f"{kind}_total"].append((t3 - t0) * 1e3)
            out["sizes"][n] = {k: statistics.median(v) for k, v in stats.items()}
            n *= 4
        lp.release()
        rp.release()
        return out

    try:
        res = agent.submit(run).result()
    finally:
        agent.close()
        owner.close()
    print(
        f"per-block dlists prepared once: {LAYERS * nb} entries per side, {res['prep_ms']:.1f} ms"
    )
    print(
        f"{'descs':>6} | {'initialize_xfer ms: create post total':>38} | "
        f"{'make_prepped_xfer ms: create post total':>40}"
    )
    for n, s in res["sizes"].items():
        print(
            f"{n:>6} | {s['init_create']:>16.3f} {s['init_post']:>9.3f} {s['init_total']:>9.3f}"
            f" | {s['prep_create']:>18.3f} {s['prep_post']:>9.3f} {s['prep_total']:>9.3f}"
        )
    print(json.dumps(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
