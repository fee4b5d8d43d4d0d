"""Planning-time benchmark for kvxferd.blocks.plan_pull (pure CPU, no transfer).

A 128K-token request of a 64-layer model (8 KV heads x 128, bf16, 16-token blocks): 8,192
blocks per layer. Cases: contiguous and random block IDs, per-layer regions (64 regions) and
cross-layer (one region), and decode TP 2 reading from prefill TP 1 (HND head slices).
Prints median and p99 planning time over ``--runs`` runs, ranges and naive descriptors.

Run from the repository root: ``python -m bench.plan_bench [--runs 50]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from kvxferd.blocks import PullPlan, plan_pull
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import GroupKind, KVCacheSpec, KVGroup, Layout, Region

LAYERS, HEADS, HEAD_SIZE, BLOCK = 64, 8, 128, 16
TOKENS = 128 * 1024
REQ_BLOCKS = TOKENS // BLOCK  # 8192
POOL_BLOCKS = 2 * REQ_BLOCKS  # registered blocks per layer (room for random IDs)


def build_spec(layout: Layout, heads: int = HEADS) -> KVCacheSpec:
    grp = KVGroup("full", GroupKind.FULL_ATTENTION, BLOCK, BLOCK)
    inner = (2, BLOCK, heads, HEAD_SIZE)
    if layout.is_cross_layer:
        regions: tuple[Region, ...] = (
            Region("kv", 0, KVDType.BF16, layout, (LAYERS, POOL_BLOCKS, *inner)),
        )
    else:
        regions = tuple(
            Region(f"layer.{i}", 0, KVDType.BF16, layout, (POOL_BLOCKS, *inner))
            for i in range(LAYERS)
        )
    return KVCacheSpec("bench-64L", (grp,), regions)


def timed(fn: Callable[[], PullPlan], runs: int) -> tuple[float, float, PullPlan]:
    plan = fn()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        plan = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
    return statistics.median(times), p99, plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)

    ids = {
        "contiguous": (np.arange(REQ_BLOCKS), np.arange(REQ_BLOCKS, 2 * REQ_BLOCKS)),
        "random": (
            rng.permutation(POOL_BLOCKS)[:REQ_BLOCKS],
            rng.permutation(POOL_BLOCKS)[:REQ_BLOCKS],
        ),
    }
    nhd, cross = build_spec(Layout.NHD), build_spec(Layout.CROSS_LAYER_NHD)
    hnd_remote, hnd_local = build_spec(Layout.HND), build_spec(Layout.HND, HEADS // 2)
    cases: list[tuple[str, str, Callable[..., PullPlan]]] = []
    for ids_name, (loc, rem) in ids.items():
        cases += [
            ("per-layer (64 regions)", ids_name, partial(plan_pull, nhd, nhd, [loc], [rem])),
            ("cross-layer (1 region)", ids_name, partial(plan_pull, cross, cross, [loc], [rem])),
            (
                "per-layer HND, TP 1->2",
                ids_name,
                partial(
                    plan_pull,
                    hnd_local,
                    hnd_remote,
                    [loc],
                    [rem],
                    local_tp=(1, 2),
                    remote_tp=(0, 1),
                ),
            ),
        ]
    print(
        f"plan_pull: {TOKENS} tokens, {LAYERS} layers, block {BLOCK}, {REQ_BLOCKS} blocks per"
        f" layer, {args.runs} runs"
    )
    hdr = f"{'layout':<24} {'ids':<11} {'median ms':>10} {'p99 ms':>8} {'ranges':>9} {'naive':>9}"
    print(hdr)
    print("-" * len(hdr))
    for name, ids_name, fn in cases:
        med, p99, plan = timed(partial(fn, prefix_caching=False), args.runs)
        print(
            f"{name:<24} {ids_name:<11} {med:>10.2f} {p99:>8.2f} {plan.num_ranges:>9}"
            f" {plan.naive_descriptors:>9}"
        )


if __name__ == "__main__":
    main()
