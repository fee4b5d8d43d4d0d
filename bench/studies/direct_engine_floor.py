"""Session 18 probe: is DIRECT's data plane slower than the bare-NIXL floor because of the
engine (kvxferd.transfer: the hand-off to the NIXL thread, InFlight's polling), or because of
something in the daemons? One owner process and one reader (kvxferd.scenario.naive), the same
32 descriptors (1 GiB of contiguous blocks, one 32 MiB range per layer) read three ways:

* floor: post and poll back to back on the agent's NIXL thread (the bench's floor row);
* engine: TransferEngine.submit of the same ranges from this thread, as the daemon's DIRECT
  pull does (its engine does not coalesce: the ranges are already one per layer);
* the engine's own post and completion times (posted_at, completed_at).

    python -m bench.studies.direct_engine_floor [--device cuda:0] [--repeat 7]

On a GPU it prepares UCX's environment as the daemons and the bench do
(``kvxferd.ipc.host.prepare_ucx_env``) before any agent starts. Session 18 ran a first version
without that on one H200: every READ went over TCP (~2 s for 1 GiB), so it measured nothing;
the corrected probe has not run on a GPU yet.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvxferd.blocks.ranges import RegionRanges, TransferPlan
from kvxferd.scenario.naive import NaiveReader, PoolShape, naive_owner
from kvxferd.transfer import TransferStatus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    if args.device.startswith("cuda"):
        from kvxferd.ipc.host import prepare_ucx_env

        print(prepare_ucx_env(args.device).reason)
    shape = PoolShape(32, 576, 65536)
    owner = naive_owner("probe-owner", shape, args.device)
    reader = NaiveReader("probe-reader", shape, args.device, owner)
    try:
        assert reader.engine is not None
        n, bb = 512, shape.block_bytes
        local, remote = np.arange(0, n, dtype=np.int64), np.arange(32, 32 + n, dtype=np.int64)
        one = np.array([n * bb], dtype=np.int64)
        ranges = tuple(
            RegionRanges(r, f"layer.{r}", local[:1] * bb, remote[:1] * bb, one)
            for r in range(shape.num_layers)
        )
        plan = TransferPlan(ranges, local_kernel_blocks=(local,), naive_descriptors=32 * n)
        floor, total, post, xfer = [], [], [], []
        for i in range(args.repeat + 2):
            f = reader.floor(local, remote).seconds
            t0 = time.monotonic()
            res = reader.engine.submit(f"probe-{i}", owner.name, plan).result(600)
            t1 = time.monotonic()
            assert res.status is TransferStatus.DONE and res.descriptors == 32, res
            if i < 2:
                continue  # warm-up
            floor.append(f)
            total.append(t1 - t0)
            post.append(res.posted_at - t0)
            xfer.append(res.completed_at - res.posted_at)

        def med(v: list[float]) -> float:
            return statistics.median(v) * 1e3

        print(f"1 GiB, 32 descriptors, {args.device}, median of {args.repeat} (ms):")
        print(f"  floor (bare, on the NIXL thread)   {med(floor):8.3f}")
        print(f"  engine submit -> result            {med(total):8.3f}")
        print(f"    of which submit -> posted        {med(post):8.3f}")
        print(f"    of which posted -> end seen      {med(xfer):8.3f}")
    finally:
        reader.close()
        owner.close()


if __name__ == "__main__":
    main()
