"""STAGED control cost per chunk through two real daemons (host memory): many tiny chunks.

A prefill and a decode daemon (dense preset with 1 KiB block rows, decode forced STAGED with
1-row slots, so every block is one chunk and the copy is negligible) run ``--pulls`` pulls of
``--blocks`` blocks; the decode daemon's "pull finished" log lines give, per pull, the summed
stage times. Prints per-chunk figures (median over pulls) and the pull's end-to-end time:

* over a Peer.Stage stream: control = reader (announcement -> READ posted) + owner (credit ->
  gather started), and the announcement latency (gather_rpc);
* over Gather (an owner without Stage, or the tree before it): the Gather round trip less the
  owner's gather time;
* the 1-min load average at start and end (``load_1min``): on a shared machine other jobs set
  the tail of the per-chunk means, so compare runs only alternately and at similar load.

    python bench/stage_control.py --pulls 20 --blocks 64 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from grpc import aio

from kvxferd.scenario.daemons import DaemonOptions, DaemonSet
from kvxferd.v1 import engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from kvxferd.wire.codec import group_ids_to_proto

TINY = "dense:num_blocks=256,num_layers=2,num_kv_heads=1,head_size=8"
ROW = 1024
TERMINAL = {5, 6, 7, 8}


def _staging(strategy: str, chunk_bytes: int, chunks: int) -> tuple[str, ...]:
    return (
        "--set", f"transfer.strategy={strategy}",
        "--set", f"transfer.staging_chunk_bytes={chunk_bytes}",
        "--set", f"transfer.staging_chunks={chunks}",
    )  # fmt: skip


async def _pulls(ds: DaemonSet, pulls: int, blocks: int) -> list[float]:
    pre, dec = ds["prefill"].ready, ds["decode"].ready
    assert pre is not None and dec is not None
    engine = engine_pb2_grpc.EngineStub(aio.insecure_channel(f"unix:{pre.engine_socket}"))
    sched = scheduler_pb2_grpc.SchedulerStub(aio.insecure_channel(dec.grpc))
    e2e = []
    for i in range(pulls):
        ids = [(7 * i + 3 * k) % 256 for k in range(blocks)]
        ids = list(dict.fromkeys(ids))
        held = await engine.Hold(
            engine_pb2.HoldRequest(request_id=f"ctl-{i}", block_ids=group_ids_to_proto([ids]))
        )
        t0 = time.perf_counter()
        resp = await sched.StartPull(
            scheduler_pb2.StartPullRequest(
                request_id=held.request_id,
                peer_address=held.peer_address,
                remote_block_ids=held.remote_block_ids,
                local_block_ids=group_ids_to_proto([list(range(len(ids)))]),
            )
        )
        watch = sched.WatchTransfers(
            scheduler_pb2.WatchTransfersRequest(transfer_ids=[resp.status.transfer_id])
        )
        async for msg in watch:
            if msg.status.state in TERMINAL:
                assert msg.status.state == 5, msg.status.error.message
                watch.cancel()
                break
        e2e.append(time.perf_counter() - t0)
    return e2e


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pulls", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        ds = DaemonSet(
            Path(tmp),
            [
                DaemonOptions("prefill", TINY, fill_seed=1, extra=_staging("auto", 4 * ROW, 8)),
                DaemonOptions("decode", TINY, extra=_staging("staged", ROW, 8)),
            ],
        )
        with ds:
            ds.start()
            ds.wait_ready()
            e2e = asyncio.run(_pulls(ds, args.pulls, args.blocks))
            lines = [
                json.loads(x)
                for x in ds["decode"].log_path.read_text().splitlines()
                if x.startswith("{") and '"pull finished"' in x
            ]
    per: dict[str, list[float]] = {}
    for rec in lines[1:]:  # the first pull warms both daemons up
        n = rec["chunks"]
        per.setdefault("chunks", []).append(n)
        per.setdefault("gather_us", []).append(rec["gather_ms"] * 1e3 / n)
        per.setdefault("announce_or_rpc_us", []).append(rec["gather_rpc_ms"] * 1e3 / n)
        per.setdefault("read_us", []).append(rec["read_ms"] * 1e3 / n)
        if rec.get("stream"):
            per.setdefault("reader_control_us", []).append(rec["control_ms"] * 1e3 / n)
            per.setdefault("owner_control_us", []).append(rec["owner_start_ms"] * 1e3 / n)
            per.setdefault("control_us", []).append(rec["control_per_chunk_us"])
        else:
            per.setdefault("control_us", []).append(
                (rec["gather_rpc_ms"] - rec["gather_ms"]) * 1e3 / n
            )
    out: dict[str, Any] = {k: statistics.median(v) for k, v in per.items()}
    out["stream"] = bool(lines and lines[-1].get("stream"))
    out["pull_ms_p50"] = statistics.median(e2e[1:]) * 1e3
    out["pull_us_per_chunk_p50"] = out["pull_ms_p50"] * 1e3 / out["chunks"]
    out["pulls"] = len(e2e) - 1
    out["load_1min"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]  # start, end
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
