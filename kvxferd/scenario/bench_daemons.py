"""The kvxferd rows of ``kvxferd bench``: a prefill and a decode daemon (``kvxferd serve``) per
strategy, every cell pulled through them with :class:`~kvxferd.scenario.puller.DaemonPuller`,
what ran recorded from the terminal status and ``ListPeers``, then the small-request latency.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvxferd.scenario.bench_cells import (
    SMALL_BLOCKS,
    WARMUP_REP,
    Cell,
    Workload,
    block_ids,
)
from kvxferd.scenario.client import DaemonClient
from kvxferd.scenario.daemons import DaemonOptions, DaemonSet
from kvxferd.scenario.mix import CONTIGUOUS, FRAGMENTED
from kvxferd.scenario.puller import PULL_DEADLINE_MS, BenchFailure, DaemonPuller, say
from kvxferd.scenario.report import percentile
from kvxferd.v1 import scheduler_pb2

PUSH = "push"
"""The bench's name for a row through two daemons in transfer.mode = push."""
CMA = "cma"
"""The bench's name for ``transfer.strategy = kernel`` on host memory: CMA pulls."""
SAME_HOST = {"KERNEL": "cuda_ipc (SM kernel)", "CMA": "process_vm_readv (CMA)"}
"""What serves a same-host copy (no NIXL READ)."""


def _record_stages(cell: Cell, st: scheduler_pb2.TransferStatus) -> None:
    cell.kvxferd_strategy = scheduler_pb2.TransferStrategy.Name(st.strategy).removeprefix(
        "TRANSFER_STRATEGY_"
    )
    if st.stage_times.chunks:
        t = st.stage_times
        for name, value in (
            ("chunks", float(t.chunks)),
            ("gather", t.gather_seconds),
            ("gather_rpc", t.gather_rpc_seconds),
            ("read", t.read_seconds),
            ("scatter", t.scatter_seconds),
            ("slot_wait", t.slot_wait_seconds),
        ):
            cell.stage_seconds.setdefault(name, []).append(value)


def _record_transport(decode: DaemonClient, cells: list[Cell]) -> None:
    """What served each row: the SM kernel for KERNEL, else the decode daemon's probed READ
    transport of the prefill peer (ListPeers)."""
    peers: list[scheduler_pb2.PeerInfo] = []
    try:
        peers = list(
            decode.scheduler.ListPeers(
                scheduler_pb2.ListPeersRequest(), timeout=10, metadata=decode.metadata
            ).peers
        )
    except Exception as exc:  # a report detail: never fail the bench on it
        say(f"  ListPeers failed: {exc}")
    read = ""
    if peers:
        p = peers[0]
        read = p.read_transport + (
            f" ({p.read_probe_gbps:.1f} GB/s probe)" if p.read_probe_gbps else ""
        )
    for cell in cells:
        cell.kvxferd_transport = SAME_HOST.get(cell.kvxferd_strategy, read or "?")


def _configured(strategy: str) -> str:
    """The decode daemon's transfer.strategy for a bench strategy name."""
    return {PUSH: "auto", CMA: "kernel"}.get(strategy, strategy)


def measure_daemons(
    workload: Workload,
    cells: list[Cell],
    workdir: Path,
    *,
    repeat: int,
    seed: int,
    verify: bool = True,
    strategy: str = "auto",
    latency_pulls: int = 0,
) -> dict[str, Any]:
    """Pull every cell ``repeat`` times through a prefill and a decode daemon running
    ``transfer.strategy = strategy``, or both in ``transfer.mode = push`` for ``"push"`` (logs
    under ``workdir``), verifying each cell's first pull
    when ``verify``; then ``latency_pulls`` small pulls. Returns the latency figures ({} when
    none were asked)."""
    pool = f"dense:num_blocks={workload.shape.num_blocks}"
    pulls = latency_pulls
    # "push": both daemons in transfer.mode = push (the prefill daemon WRITEs, docs/nixl.md §9)
    push = strategy == PUSH
    mode = ("--set", "transfer.mode=push") if push else ()
    options = [
        DaemonOptions(
            "prefill",
            pool,
            device=workload.dev_prefill,
            fill_seed=11 if verify else None,
            extra=("--set", f"transfer.default_deadline_ms={PULL_DEADLINE_MS}", *mode),
        ),
        DaemonOptions(
            "decode",
            pool,
            device=workload.dev_decode,
            extra=("--set", f"transfer.strategy={_configured(strategy)}", *mode),
        ),
    ]
    latency: dict[str, Any] = {}
    with DaemonSet(workdir, options) as daemons:
        daemons.start()
        t0 = time.monotonic()
        daemons.wait_ready()
        say(f"  daemons ready in {time.monotonic() - t0:.1f}s (logs in {workdir})")
        prefill_r, decode_r = daemons["prefill"].ready, daemons["decode"].ready
        assert prefill_r is not None and decode_r is not None
        prefill = DaemonClient("prefill", prefill_r.grpc, prefill_r.engine_socket)
        decode = DaemonClient("decode", decode_r.grpc, decode_r.engine_socket)
        puller = DaemonPuller(prefill, decode)
        try:
            puller.pull(*block_ids(workload, 256, CONTIGUOUS, WARMUP_REP, seed))  # handshake
            for cell in cells:
                say(f"  kvxferd  {cell.tokens:>6} tokens {cell.pattern}")
                for rep in range(repeat):
                    local, remote = block_ids(workload, cell.tokens, cell.pattern, rep, seed)
                    out = puller.pull(local, remote)
                    st = out.status
                    cell.kvxferd_gbps.append(st.nbytes / out.seconds / 1e9)
                    cell.kvxferd_ms.append(out.seconds * 1e3)
                    if out.server_seconds > 0:
                        cell.kvxferd_server_gbps.append(st.nbytes / out.server_seconds / 1e9)
                    if out.data_seconds > 0:
                        cell.kvxferd_data_gbps.append(st.nbytes / out.data_seconds / 1e9)
                    cell.kvxferd_descriptors_naive = st.descriptors_before_coalescing
                    cell.kvxferd_descriptors = st.descriptors_after_coalescing
                    _record_stages(cell, st)
                    if st.nbytes != cell.nbytes:
                        raise BenchFailure(
                            f"kvxferd {cell.tokens} tokens: the daemon moved {st.nbytes} bytes,"
                            f" the request is {cell.nbytes}"
                        )
                    if verify and rep == 0:
                        cell.mismatches = puller.verify(local, remote, seed + rep)
                        if cell.mismatches:
                            raise BenchFailure(
                                f"kvxferd {cell.tokens} tokens {cell.pattern}: {cell.mismatches}"
                                " sampled blocks differ from the prefill's"
                            )
            _record_transport(decode, cells)
            if push:
                for cell in cells:
                    cell.kvxferd_strategy = "PUSH"
                    cell.kvxferd_transport = f"NIXL WRITE ({cell.kvxferd_transport})"
            if not pulls:
                daemons.check_alive()
                return {}
            say(f"  latency  {pulls} pulls of {SMALL_BLOCKS} blocks ({strategy})")
            client_ms: list[float] = []
            server_ms: list[float] = []
            stages_ms: dict[str, list[float]] = {}  # the daemon's per-pull stages
            tokens = SMALL_BLOCKS * workload.spec.groups[0].kernel_block_size
            for rep in range(pulls):
                local, remote = block_ids(workload, tokens, FRAGMENTED, 1000 + rep, seed)
                out = puller.pull(local, remote)
                client_ms.append(out.seconds * 1e3)
                server_ms.append(out.server_seconds * 1e3)
                for stage in out.status.stages:
                    stages_ms.setdefault(stage.name, []).append(stage.seconds * 1e3)
            latency = {
                "blocks": SMALL_BLOCKS,
                "tokens": tokens,
                "pulls": pulls,
                "strategy": strategy,
                "bytes": workload.request_bytes(tokens),
                "client_ms": client_ms,
                "server_ms": server_ms,
                "p50_ms": percentile(client_ms, 50),
                "p90_ms": percentile(client_ms, 90),
                "p99_ms": percentile(client_ms, 99),
                "max_ms": max(client_ms),
                "server_p50_ms": percentile(server_ms, 50),
                "server_p99_ms": percentile(server_ms, 99),
                "stages_p50_ms": {k: percentile(v, 50) for k, v in stages_ms.items()},
            }
            daemons.check_alive()
        finally:
            puller.close()
            prefill.close()
            decode.close()
    problems = daemons.stop_problems()
    if problems:
        raise BenchFailure("; ".join(problems))
    return latency
