"""Session 18 probe: is DIRECT's data plane slower than the bare-NIXL floor because of the
engine (kvxferd.transfer: the hand-off to the NIXL thread, InFlight's polling), or because of
something in the daemons? One owner process and one reader (kvxferd.scenario.naive), the same
32 descriptors (1 GiB of contiguous blocks, one 32 MiB range per layer) read three ways:

* floor: post and poll back to back on the agent's NIXL thread (the bench's floor row);
* engine: TransferEngine.submit of the same ranges from this thread, as the daemon's DIRECT
  pull does (its engine does not coalesce: the ranges are already one per layer);
* the engine's own times: its post call's start and end, the end seen (TransferResult);
* each again with a timer slack of 1 us on the NIXL thread (session 19).

Session 19's first GPU run (the notification pump every daemon runs, in place of the timer
slack) found no effect of the pump, and the engine 0.31 ms slower than the floor: 0.58 ms to
the post call's end, 0.41 ms more to the end seen, against 0.75 ms for the floor's post and poll.

    python -m bench.studies.direct_engine_floor [--device cuda:0] [--repeat 7]

On a GPU it prepares UCX's environment as the daemons and the bench do
(``kvxferd.ipc.host.prepare_ucx_env``) before any agent starts. Session 18 ran a first version
without that on one H200: every READ went over TCP (~2 s for 1 GiB), so it measured nothing;
the corrected probe has not run on a GPU yet.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import numpy as np

from kvxferd.blocks.ranges import RegionRanges, TransferPlan
from kvxferd.scenario.naive import NaiveReader, PoolShape, naive_owner
from kvxferd.transfer import TransferStatus


def _set_timer_slack(ns: int) -> None:
    """This thread's timer slack (PR_SET_TIMERSLACK; 0: the process default)."""
    if ctypes.CDLL(None, use_errno=True).prctl(29, ns, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_TIMERSLACK)")


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
        rows: dict[str, list[float]] = {}
        for i in range(args.repeat + 2):
            # With the kernel's default timer slack (50 us) on the NIXL thread, then 1 us: the
            # engine sleeps 20 us between its polls of an in-flight READ (kvxferd.transfer).
            for slack_ns in (0, 1000):
                tag = f" (slack {slack_ns // 1000} us)" if slack_ns else ""
                reader.agent.submit(_set_timer_slack, slack_ns).result()
                f = reader.floor(local, remote)
                t0 = time.monotonic()
                out = reader.engine.submit(f"probe-{i}-{slack_ns}", owner.name, plan).result(600)
                t1 = time.monotonic()
                assert out.status is TransferStatus.DONE and out.descriptors == 32, out
                if i < 2:
                    continue  # warm-up
                for key, value in (
                    (f"floor: post and poll{tag}", f.seconds),
                    (f"  of which the post call{tag}", f.post_seconds),
                    (f"engine: submit -> result{tag}", t1 - t0),
                    (f"  submit -> post call begins{tag}", out.post_started_at - t0),
                    (f"  the post call{tag}", out.posted_at - out.post_started_at),
                    (f"  post returned -> end seen{tag}", out.completed_at - out.posted_at),
                    (
                        f"  data plane: post call -> end seen{tag}",
                        out.completed_at - out.post_started_at,
                    ),
                ):
                    rows.setdefault(key, []).append(value)
        reader.agent.submit(_set_timer_slack, 0).result()

        print(f"1 GiB, 32 descriptors, {args.device}, median of {args.repeat} (ms):")
        for key, values in rows.items():
            print(f"  {key:<48} {statistics.median(values) * 1e3:8.3f}")
    finally:
        reader.close()
        owner.close()


if __name__ == "__main__":
    main()
