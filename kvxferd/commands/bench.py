"""``kvxferd bench``: raw copy limit vs one descriptor per (layer, block) vs kvxferd, one table.

For each request size (tokens) and block-ID pattern, on the dense Llama-3-8B-shaped layout
(32 layers, 64 KiB per block per layer), one run measures:

* **limit**: a raw copy of the same bytes (torch ``copy_``: host memory on CPU; device to
  device on GPU, across two GPUs when there are two);
* **naive**: the vLLM connector's scheme, one NIXL descriptor per (layer, block), between two
  processes with raw NIXL agents (:mod:`kvxferd.scenario.naive`);
* **kvxferd**: a prefill and a decode daemon (``kvxferd serve``); the time from ``StartPull``
  to the terminal status on ``WatchTransfers``, bytes from the status;

then the small-request latency (16 blocks) over many pulls through the daemons. Both NIXL rows
use the same block IDs per (size, pattern, repeat), and both are checked against the owner's
bytes on a sample of blocks. Exit 0: measured and verified; 1: a transfer failed or a sampled
block differs; 2: usage error.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvxferd.commands import Subparsers, positive_int
from kvxferd.errors import KvxferdError
from kvxferd.layout import preset
from kvxferd.layout.spec import KVCacheSpec
from kvxferd.scenario import machine
from kvxferd.scenario.client import (
    TERMINAL,
    DaemonClient,
    ReleaseWatcher,
    RpcFailure,
    TransferWatcher,
    state_name,
)
from kvxferd.scenario.daemons import DaemonError, DaemonOptions, DaemonSet
from kvxferd.scenario.mix import CONTIGUOUS, FRAGMENTED, PATTERNS, Int64Array
from kvxferd.scenario.naive import NaiveOwner, NaiveReader, PoolShape
from kvxferd.scenario.report import fmt, human_bytes, json_safe, percentile, table
from kvxferd.v1 import scheduler_pb2

CPU_SIZES = (256, 1024, 4096, 8192)
GPU_SIZES = (256, 1024, 4096, 8192, 32768)
SMALL_BLOCKS = 16
VERIFY_SAMPLES = 32
PULL_DEADLINE_MS = 600_000
WAIT_TIMEOUT_S = 900.0
WARMUP_REP = 999_999  # block_ids() rep index of the warm-up pulls

_EXAMPLES = """\
examples:
  kvxferd bench                                   CPU, 256..8192 tokens, 3 repeats
  kvxferd bench --sizes 256,32768 --repeat 5 --json bench.json
  kvxferd bench --device cuda                     one GPU, or prefill cuda:0 -> decode cuda:1
  kvxferd bench --device cuda --sizes 8192 --patterns fragmented --strategy direct,staged,auto
                                                  1 GiB of random blocks, one row per strategy
"""

STRATEGIES = ("auto", "direct", "staged")


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of token counts >= 1 (e.g. 256,4096)"
        )
    return sorted(set(sizes))


def _patterns(text: str) -> list[str]:
    pats = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in pats if p not in PATTERNS]
    if not pats or bad:
        raise argparse.ArgumentTypeError(
            f"unknown pattern(s) {bad or text!r}: use {','.join(PATTERNS)}"
        )
    return list(dict.fromkeys(pats))


def _strategies(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names or any(n not in STRATEGIES for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of distinct strategies from"
            f" {','.join(STRATEGIES)} (e.g. direct,staged,auto)"
        )
    return names


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="raw copy limit vs one descriptor per (layer, block) vs kvxferd, in one table",
        description=(
            "Measure, for each request size and block-ID pattern, the raw copy limit of the"
            " same bytes, the naive one-descriptor-per-(layer, block) scheme through NIXL, and"
            " kvxferd through a prefill and a decode daemon, with ratios; then the small-request"
            " latency through the daemons. Prints the machine, versions and transports."
        ),
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (host memory, default) or cuda (cuda:0 -> cuda:1 when there are two GPUs)",
    )
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        metavar="T,T,...",
        help=(
            "request sizes in tokens (16 per block); default"
            f" {','.join(map(str, CPU_SIZES))} on CPU, {','.join(map(str, GPU_SIZES))} on GPU"
        ),
    )
    p.add_argument(
        "--patterns",
        type=_patterns,
        default=list(PATTERNS),
        metavar="P,P",
        help="block-ID patterns: contiguous, fragmented (shuffled random IDs); default both",
    )
    p.add_argument(
        "--repeat", type=positive_int, default=3, metavar="N", help="runs per cell (median; 3)"
    )
    p.add_argument(
        "--latency-pulls",
        type=positive_int,
        default=50,
        metavar="N",
        help=f"small ({SMALL_BLOCKS}-block) pulls for the latency percentiles (default 50)",
    )
    p.add_argument(
        "--strategy",
        type=_strategies,
        default=["auto"],
        metavar="S,S",
        help=(
            "transfer.strategy of the decode daemon, one kvxferd row per value: auto (the cost"
            " model picks), direct, staged; default auto. The strategy column shows what ran."
        ),
    )
    p.add_argument("--seed", type=int, default=0, metavar="S", help="block-ID seed (default 0)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write every figure as JSON")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip filling the prefill pool and the sampled byte checks (faster on big CPU runs)",
    )
    p.add_argument(
        "--log-dir",
        type=Path,
        metavar="DIR",
        help="keep the daemons' logs here (default: a temporary directory, removed on success)",
    )
    return p


# ---- the workload -------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    spec: KVCacheSpec
    shape: PoolShape
    dev_prefill: str
    dev_decode: str

    def blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.spec.groups[0].kernel_block_size)

    def request_bytes(self, tokens: int) -> int:
        return self.blocks(tokens) * self.shape.num_layers * self.shape.block_bytes


def block_ids(
    workload: Workload, tokens: int, pattern: str, rep: int, seed: int
) -> tuple[Int64Array, Int64Array]:
    """(local, remote) kernel block IDs of one cell run; the same for naive and kvxferd."""
    n, pool = workload.blocks(tokens), workload.shape.num_blocks
    rng = np.random.default_rng([seed, tokens, zlib.crc32(pattern.encode()), rep])
    if pattern == CONTIGUOUS:
        lo, ro = (int(rng.integers(0, pool - n + 1)) for _ in range(2))
        return np.arange(lo, lo + n, dtype=np.int64), np.arange(ro, ro + n, dtype=np.int64)
    local = rng.choice(pool, size=n, replace=False).astype(np.int64)
    remote = rng.choice(pool, size=n, replace=False).astype(np.int64)
    return local, remote


def make_workload(device: str, sizes: list[int]) -> Workload:
    if device == "cpu":
        dev_p = dev_d = "cpu"
    else:
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            raise KvxferdError(
                "--device cuda but torch sees no CUDA device", fix="use --device cpu here"
            )
        dev_p, dev_d = "cuda:0", "cuda:1" if count >= 2 else "cuda:0"
    probe = preset("dense", num_blocks=1)
    max_blocks = math.ceil(max(sizes) / probe.groups[0].kernel_block_size)
    # Room to place the largest request anywhere, and more blocks than the small pulls need.
    pool = max(max_blocks + max(64, max_blocks // 8), 4 * SMALL_BLOCKS)
    spec = preset("dense", num_blocks=pool)
    region = spec.regions[0]
    shape = PoolShape(len(spec.regions), pool, region.block_len)
    return Workload(spec, shape, dev_p, dev_d)


# ---- results ------------------------------------------------------------------------------


@dataclass
class Cell:
    tokens: int
    pattern: str
    blocks: int
    nbytes: int
    limit_gbps: list[float] = field(default_factory=list)
    naive_gbps: list[float] = field(default_factory=list)
    naive_descriptors: int = 0
    kvxferd_gbps: list[float] = field(default_factory=list)
    kvxferd_server_gbps: list[float] = field(default_factory=list)
    kvxferd_data_gbps: list[float] = field(default_factory=list)
    kvxferd_ms: list[float] = field(default_factory=list)
    kvxferd_descriptors_naive: int = 0
    kvxferd_descriptors: int = 0
    mismatches: int = 0
    strategy: str = "auto"  # transfer.strategy of the decode daemon
    kvxferd_strategy: str = ""  # what the daemon ran (DIRECT or STAGED), from the status
    stage_seconds: dict[str, list[float]] = field(default_factory=dict)  # STAGED only

    def for_strategy(self, strategy: str) -> Cell:
        """A row of the same request for another strategy, sharing the limit/naive figures."""
        return Cell(
            self.tokens,
            self.pattern,
            self.blocks,
            self.nbytes,
            limit_gbps=self.limit_gbps,
            naive_gbps=self.naive_gbps,
            naive_descriptors=self.naive_descriptors,
            strategy=strategy,
        )

    def median(self, name: str) -> float:
        values: list[float] = getattr(self, name)
        return statistics.median(values) if values else math.nan

    def doc(self) -> dict[str, Any]:
        limit, naive, kvx = (self.median(n) for n in ("limit_gbps", "naive_gbps", "kvxferd_gbps"))
        return {
            "tokens": self.tokens,
            "pattern": self.pattern,
            "blocks": self.blocks,
            "bytes": self.nbytes,
            "limit": {"gbps": self.limit_gbps, "median_gbps": limit},
            "naive": {
                "gbps": self.naive_gbps,
                "median_gbps": naive,
                "descriptors": self.naive_descriptors,
            },
            "kvxferd": {
                "gbps": self.kvxferd_gbps,
                "median_gbps": kvx,
                "ms": self.kvxferd_ms,
                "server_gbps": self.kvxferd_server_gbps,
                "data_plane_gbps": self.kvxferd_data_gbps,
                "descriptors_before_coalescing": self.kvxferd_descriptors_naive,
                "descriptors_after_coalescing": self.kvxferd_descriptors,
            },
            "strategy": {
                "configured": self.strategy,
                "ran": self.kvxferd_strategy,
                "stage_seconds": self.stage_seconds,
            },
            "kvxferd_vs_limit": kvx / limit if limit > 0 else math.nan,
            "kvxferd_vs_naive": kvx / naive if naive > 0 else math.nan,
            "naive_vs_limit": naive / limit if limit > 0 else math.nan,
            "mismatches": self.mismatches,
        }


class BenchFailure(Exception):
    """A transfer failed or a sampled block differs."""


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---- phase 1: raw copy --------------------------------------------------------------------


def measure_limit(workload: Workload, cells: list[Cell], repeat: int) -> None:
    """torch ``copy_`` of each cell's bytes, one copy per layer, prefill -> decode device."""
    import torch

    layers, bb = workload.shape.num_layers, workload.shape.block_bytes
    width = max(c.blocks for c in cells) * bb
    src = torch.ones((layers, width), dtype=torch.uint8, device=workload.dev_prefill)
    dst = torch.zeros((layers, width), dtype=torch.uint8, device=workload.dev_decode)

    def sync() -> None:
        for dev in {workload.dev_prefill, workload.dev_decode}:
            if dev.startswith("cuda"):
                torch.cuda.synchronize(dev)

    try:
        dst.copy_(src)  # warm-up: pages touched, peer access set up
        sync()
        for cell in cells:
            if cell.limit_gbps:  # the other pattern's cell: the same bytes
                continue
            w = cell.blocks * bb
            for i in range(repeat + 1):  # the first run warms up (thread pools, streams)
                sync()
                t0 = time.perf_counter()
                for layer in range(layers):  # contiguous per layer: a plain (peer) memcpy
                    dst[layer, :w].copy_(src[layer, :w], non_blocking=True)
                sync()
                if i:
                    cell.limit_gbps.append(cell.nbytes / (time.perf_counter() - t0) / 1e9)
            for other in cells:
                if other.tokens == cell.tokens:
                    other.limit_gbps = list(cell.limit_gbps)
    finally:
        del src, dst
        _release_memory(workload)


def _release_memory(workload: Workload) -> None:
    """Give freed buffers back (host: collect; GPU: empty torch's cache) before the next
    phase allocates its pools."""
    gc.collect()
    if workload.dev_prefill.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


# ---- phase 2: naive NIXL --------------------------------------------------------------------


def measure_naive(
    workload: Workload, cells: list[Cell], repeat: int, seed: int, verify: bool
) -> None:
    tag = secrets.token_hex(3)
    owner = NaiveOwner(f"kvxferd-bench-owner-{tag}", workload.shape, workload.dev_prefill)
    try:
        reader = NaiveReader(
            f"kvxferd-bench-reader-{tag}", workload.shape, workload.dev_decode, owner
        )
        try:
            reader.pull(*block_ids(workload, 256, CONTIGUOUS, WARMUP_REP, seed))  # warm-up
            for cell in cells:
                _say(f"  naive    {cell.tokens:>6} tokens {cell.pattern}")
                for rep in range(repeat):
                    local, remote = block_ids(workload, cell.tokens, cell.pattern, rep, seed)
                    res = reader.pull(local, remote)
                    cell.naive_gbps.append(res.gbps)
                    cell.naive_descriptors = res.descriptors
                    if verify and rep == 0:
                        bad = reader.verify(local, remote, VERIFY_SAMPLES, seed + rep)
                        if bad:
                            raise BenchFailure(
                                f"naive {cell.tokens} tokens {cell.pattern}: {bad} sampled"
                                " blocks differ from the owner's"
                            )
        finally:
            reader.close()
            del reader
    finally:
        owner.close()
        _release_memory(workload)


# ---- phase 3: kvxferd through the daemons ---------------------------------------------------


@dataclass(frozen=True)
class PullOutcome:
    seconds: float  # StartPull call -> terminal status on the stream
    status: scheduler_pb2.TransferStatus

    @property
    def server_seconds(self) -> float:
        return (self.status.finished_unix_ns - self.status.created_unix_ns) / 1e9

    @property
    def data_seconds(self) -> float:
        if not self.status.started_unix_ns:
            return math.nan
        return (self.status.finished_unix_ns - self.status.started_unix_ns) / 1e9


class DaemonPuller:
    """Hold on the prefill engine, StartPull on the decode daemon, wait on one stream."""

    def __init__(self, prefill: DaemonClient, decode: DaemonClient) -> None:
        self.prefill = prefill
        self.decode = decode
        self.watcher = TransferWatcher(decode)
        self.releases = ReleaseWatcher(prefill)
        self.tag = secrets.token_hex(3)
        self._n = 0

    def close(self) -> None:
        self.watcher.close()
        self.releases.close()

    def pull(self, local: Int64Array, remote: Int64Array) -> PullOutcome:
        self._n += 1
        rid = f"bench-{self.tag}-{self._n}"
        hold = self.prefill.hold(rid, [remote])
        pending = self.watcher.expect(f"{rid}-pull")
        t0 = time.perf_counter()
        resp = self.decode.start_pull(
            pending.transfer_id, hold, [local], deadline_ms=PULL_DEADLINE_MS
        )
        if resp.status.state in TERMINAL:
            self.watcher.resolve(pending, resp.status, "StartPull")
        st = self.watcher.wait(pending, WAIT_TIMEOUT_S)
        seconds = pending.terminal_at - t0
        if st.state != scheduler_pb2.TRANSFER_STATE_DONE:
            why = st.error.message if st.HasField("error") else "no error detail"
            raise BenchFailure(f"pull {rid} ended {state_name(st.state)}: {why}")
        # Not timed: let the prefill daemon release the blocks before they are held again.
        if self.releases.wait([rid], 10.0) and not self.releases.error:
            raise BenchFailure(f"the prefill daemon did not release {rid} within 10s")
        return PullOutcome(seconds, st)

    def verify(self, local: Int64Array, remote: Int64Array, seed: int) -> int:
        rng = np.random.default_rng(seed)
        pick = rng.choice(local.size, size=min(VERIFY_SAMPLES, local.size), replace=False)
        mine = self.decode.checksum(0, local[pick])
        theirs = self.prefill.checksum(0, remote[pick])
        return sum(1 for a, b in zip(mine, theirs, strict=True) if a != b)


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


def measure_daemons(
    workload: Workload,
    cells: list[Cell],
    args: argparse.Namespace,
    workdir: Path,
    *,
    strategy: str = "auto",
    latency_pulls: int | None = None,
) -> dict[str, Any]:
    pool = f"dense:num_blocks={workload.shape.num_blocks}"
    pulls = args.latency_pulls if latency_pulls is None else latency_pulls
    verify = not args.no_verify
    options = [
        DaemonOptions(
            "prefill",
            pool,
            device=workload.dev_prefill,
            fill_seed=11 if verify else None,
            extra=("--set", f"transfer.default_deadline_ms={PULL_DEADLINE_MS}"),
        ),
        DaemonOptions(
            "decode",
            pool,
            device=workload.dev_decode,
            extra=("--set", f"transfer.strategy={strategy}"),
        ),
    ]
    latency: dict[str, Any] = {}
    with DaemonSet(workdir, options) as daemons:
        daemons.start()
        t0 = time.monotonic()
        daemons.wait_ready()
        _say(f"  daemons ready in {time.monotonic() - t0:.1f}s (logs in {workdir})")
        prefill_r, decode_r = daemons["prefill"].ready, daemons["decode"].ready
        assert prefill_r is not None and decode_r is not None
        prefill = DaemonClient("prefill", prefill_r.grpc, prefill_r.engine_socket)
        decode = DaemonClient("decode", decode_r.grpc, decode_r.engine_socket)
        puller = DaemonPuller(prefill, decode)
        try:
            puller.pull(*block_ids(workload, 256, CONTIGUOUS, WARMUP_REP, args.seed))  # handshake
            for cell in cells:
                _say(f"  kvxferd  {cell.tokens:>6} tokens {cell.pattern}")
                for rep in range(args.repeat):
                    local, remote = block_ids(workload, cell.tokens, cell.pattern, rep, args.seed)
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
                        cell.mismatches = puller.verify(local, remote, args.seed + rep)
                        if cell.mismatches:
                            raise BenchFailure(
                                f"kvxferd {cell.tokens} tokens {cell.pattern}: {cell.mismatches}"
                                " sampled blocks differ from the prefill's"
                            )
            if not pulls:
                daemons.check_alive()
                return {}
            _say(f"  latency  {pulls} pulls of {SMALL_BLOCKS} blocks ({strategy})")
            client_ms: list[float] = []
            server_ms: list[float] = []
            tokens = SMALL_BLOCKS * workload.spec.groups[0].kernel_block_size
            for rep in range(pulls):
                local, remote = block_ids(workload, tokens, FRAGMENTED, 1000 + rep, args.seed)
                out = puller.pull(local, remote)
                client_ms.append(out.seconds * 1e3)
                server_ms.append(out.server_seconds * 1e3)
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


# ---- report ---------------------------------------------------------------------------------


def results_table(cells: list[Cell]) -> str:
    rows = []
    for c in cells:
        d = c.doc()
        rows.append(
            [
                str(c.tokens),
                c.pattern,
                f"{c.strategy}: {c.kvxferd_strategy or '?'}",
                human_bytes(c.nbytes),
                fmt(d["limit"]["median_gbps"]),
                fmt(d["naive"]["median_gbps"]),
                f"{c.naive_descriptors:,}",
                fmt(d["kvxferd"]["median_gbps"]),
                f"{c.kvxferd_descriptors:,}",
                fmt(d["kvxferd_vs_limit"]),
                fmt(d["kvxferd_vs_naive"]),
            ]
        )
    headers = [
        "tokens",
        "pattern",
        "strategy",
        "bytes",
        "limit GB/s",
        "naive GB/s",
        "naive descs",
        "kvxferd GB/s",
        "kvxferd descs",
        "x limit",
        "x naive",
    ]
    return table(headers, rows, left=0)


def run(args: argparse.Namespace) -> int:
    sizes: list[int] = args.sizes or list(CPU_SIZES if args.device == "cpu" else GPU_SIZES)
    workload = make_workload(args.device, sizes)
    info, vers, env = machine.machine(), machine.versions(), machine.transports()
    base = [
        Cell(t, p, workload.blocks(t), workload.request_bytes(t), strategy=args.strategy[0])
        for t in sizes
        for p in args.patterns
    ]
    rows_by = {s: [c.for_strategy(s) for c in base] for s in args.strategy[1:]}
    rows_by[args.strategy[0]] = base
    cells = [c for s in args.strategy for c in rows_by[s]]
    pool_bytes = workload.shape.num_layers * workload.shape.layer_bytes
    header = [
        f"kvxferd bench: {workload.spec.model}-shaped KV cache ({workload.shape.num_layers} layers"
        f" x {human_bytes(workload.shape.block_bytes)} per block per layer, 16 tokens per"
        f" block), {workload.dev_prefill} -> {workload.dev_decode}, pools of"
        f" {workload.shape.num_blocks} blocks ({human_bytes(pool_bytes)}) per side,"
        f" median of {args.repeat}",
        *machine.describe(info, vers, env),
    ]
    for line in header:
        print(line, flush=True)
    workdir = args.log_dir
    temporary = workdir is None
    if workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="kvxb-"))
    else:
        workdir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "command": "kvxferd " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": info,
        "versions": vers,
        "transports": env,
        "device": args.device,
        "devices": {"prefill": workload.dev_prefill, "decode": workload.dev_decode},
        "layout": {
            "preset": "dense",
            "num_layers": workload.shape.num_layers,
            "block_bytes": workload.shape.block_bytes,
            "tokens_per_block": workload.spec.groups[0].kernel_block_size,
            "pool_blocks": workload.shape.num_blocks,
        },
        "repeat": args.repeat,
        "seed": args.seed,
        "strategies": args.strategy,
        "verified": not args.no_verify,
    }
    error = ""
    latency: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        _say("raw copy limit ...")
        measure_limit(workload, base, args.repeat)
        _say("naive: one NIXL descriptor per (layer, block), two processes ...")
        measure_naive(workload, base, args.repeat, args.seed, not args.no_verify)
        for i, strategy in enumerate(args.strategy):
            _say(f"kvxferd: prefill and decode daemons, transfer.strategy = {strategy} ...")
            (workdir / strategy).mkdir(parents=True, exist_ok=True)
            for row, b in zip(rows_by[strategy], base, strict=True):
                row.naive_descriptors = b.naive_descriptors
            got = measure_daemons(
                workload,
                rows_by[strategy],
                args,
                workdir / strategy,
                strategy=strategy,
                latency_pulls=None if i == 0 else 0,
            )
            latency = latency or got
    except (BenchFailure, DaemonError, RpcFailure) as exc:
        error = str(exc)
    except Exception as exc:  # NIXL, torch, the owner process: report, still print the table
        error = f"{type(exc).__name__}: {exc}"
    doc["wall_s"] = time.monotonic() - t0
    doc["rows"] = [c.doc() for c in cells]
    doc["latency"] = latency
    doc["error"] = error
    doc["ok"] = not error
    print("")
    print(results_table(cells))
    print(
        "\nlimit: torch copy_ of the same bytes; naive: one NIXL descriptor per (layer, block);"
        " kvxferd: StartPull to terminal status on WatchTransfers through two daemons;"
        " strategy: the decode daemon's transfer.strategy: what ran (DIRECT or STAGED);"
        " x limit / x naive: kvxferd's median over theirs"
    )
    for c in cells:
        if c.stage_seconds:
            med = {k: statistics.median(v) for k, v in c.stage_seconds.items()}
            print(
                f"STAGED stages, {c.tokens} tokens {c.pattern} ({c.strategy}): {med['chunks']:.0f}"
                f" chunks; summed over chunks (median): gather {med['gather'] * 1e3:.2f} ms,"
                f" gather RPC {med['gather_rpc'] * 1e3:.2f} ms, read {med['read'] * 1e3:.2f} ms,"
                f" scatter {med['scatter'] * 1e3:.2f} ms, slot wait"
                f" {med['slot_wait'] * 1e3:.2f} ms"
            )
    if latency:
        print(
            f"small-request latency ({latency['blocks']} blocks = {latency['tokens']} tokens,"
            f" {human_bytes(latency['bytes'])}, {latency['pulls']} pulls, StartPull to terminal"
            f" status on WatchTransfers): p50 {latency['p50_ms']:.2f} ms, p90"
            f" {latency['p90_ms']:.2f} ms, p99 {latency['p99_ms']:.2f} ms, max"
            f" {latency['max_ms']:.2f} ms (daemon-side p50 {latency['server_p50_ms']:.2f} ms,"
            f" p99 {latency['server_p99_ms']:.2f} ms)"
        )
    print(f"\nresult: {'OK' if not error else 'FAILED: ' + error}  (wall {doc['wall_s']:.1f}s)")
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(json_safe(doc), indent=2) + "\n")
        except OSError as exc:
            print(f"kvxferd: error: cannot write {args.json}: {exc}", file=sys.stderr)
            error = error or f"cannot write {args.json}"
    if error:
        print(f"daemon logs kept in {workdir}")
    elif temporary:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if not error else 1
