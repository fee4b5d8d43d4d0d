"""The kvxferd rows of ``kvxferd bench``: a prefill and a decode daemon (``kvxferd serve``) per
strategy, every cell pulled through them with :class:`~kvxferd.scenario.puller.DaemonPuller`,
what ran recorded from the terminal status and ``ListPeers``, then the small-request latency.
"""

from __future__ import annotations

import math
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
    for stage in st.stages:  # the daemon's own stages, decode to publish
        cell.stage_seconds.setdefault(stage.name, []).append(stage.seconds)
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
    warmup: int = 1,
) -> dict[str, Any]:
    """Pull every cell ``repeat`` times through a prefill and a decode daemon running
    ``transfer.strategy = strategy``, or both in ``transfer.mode = push`` for ``"push"`` (logs
    under ``workdir``), after ``warmup`` untimed pulls of the cell, verifying each cell's last
    timed pull when ``verify``; then ``latency_pulls`` small pulls. Returns the latency
    figures ({} when none were asked)."""
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
            scheduler_socket=True,
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
        decode = DaemonClient(
            "decode",
            decode_r.grpc,
            decode_r.engine_socket,
            scheduler_socket=decode_r.scheduler_socket,
        )
        puller = DaemonPuller(prefill, decode)
        try:
            puller.pull(*block_ids(workload, 256, CONTIGUOUS, WARMUP_REP, seed))  # handshake
            for cell in cells:
                say(f"  kvxferd  {cell.tokens:>6} tokens {cell.pattern}")
                # Untimed: the first pulls of a size (buffers and tables grown, kernels loaded),
                # each of other blocks, as traffic is: the first two pulls of new blocks after
                # a repeated one ran up to 1.5x slower (docs/benchmarks.md, Session 26).
                for k in range(warmup):
                    warm = block_ids(workload, cell.tokens, cell.pattern, WARMUP_REP + k, seed)
                    puller.pull(*warm)
                for rep in range(repeat):
                    local, remote = block_ids(workload, cell.tokens, cell.pattern, rep, seed)
                    out = puller.pull(local, remote, socket=True)
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
                    # The last pull is checked: Checksum's work on both daemons would slow
                    # the next timed pull.
                    if verify and rep == repeat - 1:
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
            say(f"  latency  {pulls} pulls of {SMALL_BLOCKS} blocks each way ({strategy})")
            latency = _latency(puller, workload, pulls, seed, strategy)
            daemons.check_alive()
        finally:
            puller.close()
            prefill.close()
            decode.close()
    problems = daemons.stop_problems()
    if problems:
        raise BenchFailure("; ".join(problems))
    return latency


def _figures(
    client_ms: list[float], server_ms: list[float], stages: dict[str, list[float]]
) -> dict[str, Any]:
    return {
        "client_ms": client_ms,
        "server_ms": server_ms,
        "p50_ms": percentile(client_ms, 50),
        "p90_ms": percentile(client_ms, 90),
        "p99_ms": percentile(client_ms, 99),
        "max_ms": max(client_ms),
        "server_p50_ms": percentile(server_ms, 50),
        "server_p99_ms": percentile(server_ms, 99),
        "stages_p50_ms": {k: percentile(v, 50) for k, v in stages.items()},
    }


# Latency pulls rotate between the ways of waiting in blocks of at most this many.
LATENCY_BLOCK = 20
# How the caller waits: StartPull then the status on WatchTransfers (gRPC), StartPull with
# wait over gRPC, StartPull with wait on the decode daemon's scheduler socket.
WATCH, WAIT, SOCKET = "watch", "wait", "socket"


def _latency(
    puller: DaemonPuller, workload: Workload, pulls: int, seed: int, strategy: str
) -> dict[str, Any]:
    """``pulls`` small pulls each way, in rotating blocks (the same conditions for all):
    StartPull and the terminal status on WatchTransfers (the top-level figures), StartPull
    with ``wait`` over gRPC (under ``"wait"``) and on the scheduler socket (``"socket"``); the
    ``wait`` blocks run with the stream closed, as a caller that waits with StartPull watches
    nothing. After each pull, one GetTransfer of it is timed the same way as the pull asked
    (gRPC under ``"rpc"``, the socket under ``"socket_rpc"``): a unary call to the decode
    daemon by the same client with the same answer as StartPull with ``wait``, the control
    path's floor that the daemon's work adds to."""
    tokens = SMALL_BLOCKS * workload.spec.groups[0].kernel_block_size
    modes = (WATCH, WAIT, SOCKET)
    runs: dict[str, tuple[list[float], list[float], dict[str, list[float]]]] = {
        m: ([], [], {}) for m in modes
    }
    rpc_ms: dict[bool, list[float]] = {False: [], True: []}
    release_ms: list[float] = []  # each pull's answer -> its release seen on WatchReleases
    block = max(1, min(LATENCY_BLOCK, pulls // 4))
    order = [
        m
        for start in range(0, pulls, block)
        for m in modes
        for _ in range(min(block, pulls - start))
    ]
    for rep, mode in enumerate(order):
        if rep == 0 or mode != order[rep - 1]:
            puller.watching(mode == WATCH)  # untimed: the stream is registered before the block
            if mode == WATCH:  # a new watch-all stream starts with every known pull: drain it
                puller.pull(*block_ids(workload, tokens, FRAGMENTED, 5000 + rep, seed))
        local, remote = block_ids(workload, tokens, FRAGMENTED, 1000 + rep, seed)
        out = puller.pull(local, remote, wait=mode == WAIT, socket=mode == SOCKET)
        t0 = time.perf_counter()
        puller.decode.get_transfer(out.status.transfer_id, local=mode == SOCKET)
        rpc_ms[mode == SOCKET].append((time.perf_counter() - t0) * 1e3)
        client_ms, server_ms, stages_ms = runs[mode]
        client_ms.append(out.seconds * 1e3)
        if not math.isnan(out.release_seconds):  # NaN: the WatchReleases stream failed
            release_ms.append(out.release_seconds * 1e3)
        server_ms.append(out.server_seconds * 1e3)
        for stage in out.status.stages:
            stages_ms.setdefault(stage.name, []).append(stage.seconds * 1e3)
    return {
        "blocks": SMALL_BLOCKS,
        "tokens": tokens,
        "pulls": pulls,
        "strategy": strategy,
        "bytes": workload.request_bytes(tokens),
        **_figures(*runs[WATCH]),
        WAIT: _figures(*runs[WAIT]),
        SOCKET: _figures(*runs[SOCKET]),
        "rpc": _rpc_floor(rpc_ms[False], "gRPC"),
        "socket_rpc": _rpc_floor(rpc_ms[True], "the scheduler socket"),
        "release": {
            "ms": release_ms,
            "p50_ms": percentile(release_ms, 50),
            "p99_ms": percentile(release_ms, 99),
            "what": "each pull's terminal status seen -> the prefill daemon's release of its"
            " request seen on WatchReleases: how long the owner holds the blocks after the pull",
        },
    }


def _rpc_floor(ms: list[float], how: str) -> dict[str, Any]:
    return {
        "ms": ms,
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "what": f"GetTransfer of the pull just finished over {how}: one unary call to the"
        " decode daemon by the same client, the same answer as StartPull with wait",
    }


def floor_ms(base: list[Cell], latency: dict[str, Any]) -> float | None:
    """The bare-NIXL floor's time for a small pull: the floor row of the cell with the latency
    pulls' size and pattern (fragmented), when the bench measured one."""
    for cell in base:
        if cell.tokens == latency["tokens"] and cell.pattern == FRAGMENTED and cell.floor_gbps:
            gbps = cell.median("floor_gbps")
            if gbps > 0:
                return float(latency["bytes"]) / (gbps * 1e9) * 1e3
    return None


def latency_line(how: str, fig: dict[str, Any], floor: float | None) -> str:
    """One way of waiting for the small pulls: percentiles, the daemon's side, the stages, and
    what the daemons added over the floor (also recorded in ``fig``: ``added_p50_ms``,
    ``added_p99_ms``)."""
    text = (
        f"  {how}: p50 {fig['p50_ms']:.2f} ms, p90 {fig['p90_ms']:.2f} ms, p99"
        f" {fig['p99_ms']:.2f} ms, max {fig['max_ms']:.2f} ms (daemon side p50"
        f" {fig['server_p50_ms']:.2f} ms, p99 {fig['server_p99_ms']:.2f} ms)"
    )
    if floor is not None:
        fig["added_p50_ms"] = fig["p50_ms"] - floor
        fig["added_p99_ms"] = fig["p99_ms"] - floor
        text += (
            f"; added over the floor p50 {fig['added_p50_ms']:.2f} ms,"
            f" p99 {fig['added_p99_ms']:.2f} ms"
        )
    if fig.get("stages_p50_ms"):
        parts = ", ".join(f"{k} {v:.2f}" for k, v in fig["stages_p50_ms"].items())
        text += f"\n    stages p50 (ms): {parts}"
    return text
