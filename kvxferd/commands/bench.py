"""``kvxferd bench``: raw copy, naive, the bare-NIXL floor and every strategy, one table.

For each request size (tokens) and block-ID pattern, on the dense Llama-3-8B-shaped layout
(32 layers, 64 KiB per block per layer), one run measures:

* **raw copy**: a raw copy of the same bytes (torch ``copy_``: host memory on CPU; device to
  device on GPU, across two GPUs when there are two), warmed up and repeated, the faster of
  one contiguous copy and one copy per layer, so that no row of the same run can beat it;
* **naive**: the vLLM connector's scheme, one NIXL descriptor per (layer, block), between two
  processes with raw NIXL agents (:mod:`kvxferd.scenario.naive`);
* **floor**: the descriptors a DIRECT pull posts (the naive ranges coalesced), posted as one
  READ by the same raw agents in a plain post/poll loop: what NIXL itself costs, no daemon;
* **kvxferd**, one row per ``--strategy`` (``kernel``, ``direct``, ``staged``, ``auto``): a
  prefill and a decode daemon (``kvxferd serve``); the time from ``StartPull`` to the terminal
  status on ``WatchTransfers``, bytes from the status; the row names what ran;

each with GB/s, x raw and x naive, and the transport it used (raw: the copy engine; naive and
floor: inferred from the floor's rate like the daemons' probe; kvxferd: the decode daemon's
``ListPeers`` ``read_transport``, or the SM kernel for KERNEL). Then the small-request latency
(16 blocks) over many pulls through the daemons of the first strategy. On GPU the bench sets
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` as the daemons do (kvxferd.ipc.host) before its own agents
start, so naive and floor run over what the daemons run over. Every NIXL row uses the same
block IDs per (size, pattern, repeat) and is checked against the owner's bytes on a sample of
blocks. Exit 0: measured and verified; 1: a transfer failed or a sampled block differs; 2:
usage error.
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
  kvxferd bench --device cuda --sizes 256,8192 --strategy kernel,direct,staged,auto
                                                  one row per strategy beside raw, naive, floor
"""

STRATEGIES = ("auto", "direct", "staged", "kernel")


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
            f" {','.join(STRATEGIES)} (e.g. kernel,direct,staged,auto)"
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
            "transfer.strategy of the decode daemon, one kvxferd row per value: auto (KERNEL"
            " where eligible, else the cost model picks), direct, staged, kernel; default auto."
            " Each row shows what ran."
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
    limit_how: str = ""  # which raw copy was faster: one contiguous copy or one per layer
    naive_gbps: list[float] = field(default_factory=list)
    naive_descriptors: int = 0
    floor_gbps: list[float] = field(default_factory=list)
    floor_descriptors: int = 0
    nixl_transport: str = ""  # naive and floor rows, inferred from the floor's rate
    kvxferd_transport: str = ""  # the decode daemon's read transport, or the SM kernel
    kvxferd_gbps: list[float] = field(default_factory=list)
    kvxferd_server_gbps: list[float] = field(default_factory=list)
    kvxferd_data_gbps: list[float] = field(default_factory=list)
    kvxferd_ms: list[float] = field(default_factory=list)
    kvxferd_descriptors_naive: int = 0
    kvxferd_descriptors: int = 0
    mismatches: int = 0
    failed: str = ""  # why this strategy's daemons could not measure the row
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
            limit_how=self.limit_how,
            naive_gbps=self.naive_gbps,
            naive_descriptors=self.naive_descriptors,
            floor_gbps=self.floor_gbps,
            floor_descriptors=self.floor_descriptors,
            nixl_transport=self.nixl_transport,
            strategy=strategy,
        )

    def median(self, name: str) -> float:
        values: list[float] = getattr(self, name)
        return statistics.median(values) if values else math.nan

    def doc(self) -> dict[str, Any]:
        limit, naive, floor, kvx = (
            self.median(n) for n in ("limit_gbps", "naive_gbps", "floor_gbps", "kvxferd_gbps")
        )

        def ratios(gbps: float) -> dict[str, float]:
            return {
                "x_raw": gbps / limit if limit > 0 else math.nan,
                "x_naive": gbps / naive if naive > 0 else math.nan,
            }

        return {
            "tokens": self.tokens,
            "pattern": self.pattern,
            "blocks": self.blocks,
            "bytes": self.nbytes,
            "limit": {
                "gbps": self.limit_gbps,
                "median_gbps": limit,
                "how": self.limit_how,
                "transport": "copy engine (torch copy_)",
            },
            "naive": {
                "gbps": self.naive_gbps,
                "median_gbps": naive,
                "descriptors": self.naive_descriptors,
                "transport": self.nixl_transport,
                **ratios(naive),
            },
            "floor": {
                "gbps": self.floor_gbps,
                "median_gbps": floor,
                "descriptors": self.floor_descriptors,
                "transport": self.nixl_transport,
                **ratios(floor),
            },
            "kvxferd": {
                "gbps": self.kvxferd_gbps,
                "median_gbps": kvx,
                "descriptors": self.kvxferd_descriptors,
                "transport": self.kvxferd_transport,
                **ratios(kvx),
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
            "kvxferd_vs_floor": kvx / floor if floor > 0 else math.nan,
            "naive_vs_limit": naive / limit if limit > 0 else math.nan,
            "floor_vs_limit": floor / limit if limit > 0 else math.nan,
            "mismatches": self.mismatches,
            "failed": self.failed,
        }


class BenchFailure(Exception):
    """A transfer failed or a sampled block differs."""


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---- phase 1: raw copy --------------------------------------------------------------------


def measure_limit(workload: Workload, cells: list[Cell], repeat: int) -> None:
    """torch ``copy_`` of each cell's bytes, prefill -> decode device: one contiguous copy and
    one copy per layer, each warmed up and repeated at least 10 times; the faster median is the
    raw copy (so a one-descriptor NIXL READ of the same bytes cannot beat it in the table)."""
    try:
        _measure_limit(workload, cells, repeat)
    finally:
        _release_memory(workload)


def _measure_limit(workload: Workload, cells: list[Cell], repeat: int) -> None:
    import torch

    layers, bb = workload.shape.num_layers, workload.shape.block_bytes
    width = max(c.blocks for c in cells) * bb
    src = torch.ones(layers * width, dtype=torch.uint8, device=workload.dev_prefill)
    dst = torch.zeros(layers * width, dtype=torch.uint8, device=workload.dev_decode)
    src2, dst2 = src.view(layers, width), dst.view(layers, width)
    runs = max(repeat, 10)

    def sync() -> None:
        for dev in {workload.dev_prefill, workload.dev_decode}:
            if dev.startswith("cuda"):
                torch.cuda.synchronize(dev)

    def timed(copy: Any) -> list[float]:
        for _ in range(3):  # warm-up: pages touched, peer access, streams, clocks
            copy()
        out = []
        for _ in range(runs):
            sync()
            t0 = time.perf_counter()
            copy()
            sync()
            out.append(time.perf_counter() - t0)
        return out

    for cell in cells:
        if cell.limit_gbps:  # the other pattern's cell: the same bytes
            continue
        w, n = cell.blocks * bb, cell.nbytes

        def one(n: int = n) -> None:
            dst[:n].copy_(src[:n], non_blocking=True)

        def per_layer(w: int = w) -> None:
            for layer in range(layers):  # contiguous per layer: a plain (peer) memcpy
                dst2[layer, :w].copy_(src2[layer, :w], non_blocking=True)

        best: tuple[float, str, list[float]] = (math.inf, "", [])
        for how, fn in (
            ("one contiguous copy", one),
            (f"{layers} per-layer copies", per_layer),
        ):
            secs = timed(fn)
            if statistics.median(secs) < best[0]:
                best = (statistics.median(secs), how, secs)
        cell.limit_gbps = [cell.nbytes / t / 1e9 for t in best[2]]
        cell.limit_how = best[1]
        for other in cells:
            if other.tokens == cell.tokens:
                other.limit_gbps, other.limit_how = list(cell.limit_gbps), cell.limit_how


def _release_memory(workload: Workload) -> None:
    """Give freed buffers back (host: collect; GPU: empty torch's cache) before the next
    phase allocates its pools."""
    gc.collect()
    if workload.dev_prefill.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


# ---- phase 2: naive NIXL --------------------------------------------------------------------


def _poison(reader: NaiveReader, local: Int64Array) -> None:
    """Overwrite the reader's destination blocks, so that a verify checks the last pull only."""
    import torch

    ids = torch.as_tensor(local, device=reader.tensors[0].device)
    for t in reader.tensors:
        t.view(-1, reader.shape.block_bytes)[ids] = 0xA5


def measure_naive(
    workload: Workload, cells: list[Cell], repeat: int, seed: int, verify: bool
) -> None:
    """The naive scheme and the bare-NIXL floor, the same block IDs for both, per repeat."""
    tag = secrets.token_hex(3)
    owner = NaiveOwner(f"kvxferd-bench-owner-{tag}", workload.shape, workload.dev_prefill)
    try:
        reader = NaiveReader(
            f"kvxferd-bench-reader-{tag}", workload.shape, workload.dev_decode, owner
        )
        try:
            warm = block_ids(workload, 256, CONTIGUOUS, WARMUP_REP, seed)
            reader.pull(*warm)  # warm-up: UCX connects and maps
            reader.floor(*warm)
            for cell in cells:
                _say(f"  naive    {cell.tokens:>6} tokens {cell.pattern} (and the floor)")
                for rep in range(repeat):
                    local, remote = block_ids(workload, cell.tokens, cell.pattern, rep, seed)
                    for name, pull in (("naive", reader.pull), ("floor", reader.floor)):
                        if verify and rep == 0:
                            _poison(reader, local)
                        res = pull(local, remote)
                        if name == "naive":
                            cell.naive_gbps.append(res.gbps)
                            cell.naive_descriptors = res.descriptors
                        else:
                            cell.floor_gbps.append(res.gbps)
                            cell.floor_descriptors = res.descriptors
                        if verify and rep == 0:
                            bad = reader.verify(local, remote, VERIFY_SAMPLES, seed + rep)
                            if bad:
                                raise BenchFailure(
                                    f"{name} {cell.tokens} tokens {cell.pattern}: {bad} sampled"
                                    " blocks differ from the owner's"
                                )
        finally:
            reader.close()
            del reader
    finally:
        owner.close()
        _release_memory(workload)


def nixl_transport(workload: Workload, cells: list[Cell]) -> None:
    """Name what the naive and floor rows ran over, from the floor's best rate (the rule the
    daemons' probe uses: kvxferd.ipc.transport.classify)."""
    from kvxferd.ipc.transport import classify

    vram = workload.dev_prefill.startswith("cuda")
    for cell in cells:
        if not cell.floor_gbps:
            continue
        r = classify(local_vram=vram, remote_vram=vram, same_host=True, gbps=max(cell.floor_gbps))
        cell.nixl_transport = r.name


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
        _say(f"  ListPeers failed: {exc}")
    read = ""
    if peers:
        p = peers[0]
        read = p.read_transport + (
            f" ({p.read_probe_gbps:.1f} GB/s probe)" if p.read_probe_gbps else ""
        )
    for cell in cells:
        cell.kvxferd_transport = (
            "cuda_ipc (SM kernel)" if cell.kvxferd_strategy == "KERNEL" else read or "?"
        )


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
            _record_transport(decode, cells)
            if not pulls:
                daemons.check_alive()
                return {}
            _say(f"  latency  {pulls} pulls of {SMALL_BLOCKS} blocks ({strategy})")
            client_ms: list[float] = []
            server_ms: list[float] = []
            stages_ms: dict[str, list[float]] = {}  # the daemon's per-pull stages
            tokens = SMALL_BLOCKS * workload.spec.groups[0].kernel_block_size
            for rep in range(pulls):
                local, remote = block_ids(workload, tokens, FRAGMENTED, 1000 + rep, args.seed)
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


# ---- report ---------------------------------------------------------------------------------


def _ratio(x: float, base: float) -> str:
    return fmt(x / base) if base > 0 and not math.isnan(x) else "-"


def results_table(cells: list[Cell], strategies: list[str]) -> str:
    """One table: per (tokens, pattern), the raw copy, naive, floor, then one row per strategy."""
    rows: list[list[str]] = []
    seen: set[tuple[int, str]] = set()
    for base in cells:
        key = (base.tokens, base.pattern)
        if key in seen:
            continue
        seen.add(key)
        same = [c for c in cells if (c.tokens, c.pattern) == key]
        same.sort(key=lambda c: strategies.index(c.strategy))
        raw, naive, floor = (base.median(n) for n in ("limit_gbps", "naive_gbps", "floor_gbps"))
        head = [str(base.tokens), base.pattern]
        size = human_bytes(base.nbytes)

        entries = [
            (f"raw copy ({base.limit_how or '?'})", raw, "-", "copy engine (torch copy_)"),
            (
                "naive (1 desc per layer x block)",
                naive,
                f"{base.naive_descriptors:,}",
                base.nixl_transport or "?",
            ),
            (
                "floor (DIRECT's descs, bare NIXL)",
                floor,
                f"{base.floor_descriptors:,}",
                base.nixl_transport or "?",
            ),
        ]
        for c in same:
            entries.append(
                (
                    f"kvxferd {c.strategy}: {c.kvxferd_strategy or '?'}",
                    c.median("kvxferd_gbps"),
                    f"{c.kvxferd_descriptors:,}" if c.kvxferd_gbps else "-",
                    "FAILED (see below)" if c.failed else c.kvxferd_transport or "?",
                )
            )
        for name, gbps, descs, transport in entries:
            x_raw, x_naive = _ratio(gbps, raw), _ratio(gbps, naive)
            rows.append([*head, name, size, fmt(gbps), x_raw, x_naive, descs, transport])
    headers = [
        "tokens",
        "pattern",
        "row",
        "bytes",
        "GB/s",
        "x raw",
        "x naive",
        "descs",
        "transport",
    ]
    return table(headers, rows, left=0)


def _share(base: list[Cell], rows_by: dict[str, list[Cell]]) -> None:
    """Copy the raw, naive and floor figures of each base cell to every strategy's row."""
    for cells in rows_by.values():
        for row, b in zip(cells, base, strict=True):
            if row is b:
                continue
            row.limit_gbps, row.limit_how = b.limit_gbps, b.limit_how
            row.naive_gbps, row.naive_descriptors = b.naive_gbps, b.naive_descriptors
            row.floor_gbps, row.floor_descriptors = b.floor_gbps, b.floor_descriptors
            row.nixl_transport = b.nixl_transport


def run(args: argparse.Namespace) -> int:
    sizes: list[int] = args.sizes or list(CPU_SIZES if args.device == "cpu" else GPU_SIZES)
    workload = make_workload(args.device, sizes)
    ucx_note = ""
    if args.device == "cuda":
        # As the daemons do before their NIXL agents start, so naive and floor run over what
        # the daemons run over (the spawned owner process inherits the environment).
        from kvxferd.ipc.host import prepare_ucx_env

        note = prepare_ucx_env(workload.dev_prefill)
        ucx_note = (
            "set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y: " if note.set_get_zcopy else ""
        ) + note.reason
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
        *([f"ucx env:    {ucx_note}"] if ucx_note else []),
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
        "ucx_env": ucx_note,
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
        nixl_transport(workload, base)
        _share(base, rows_by)
        for i, strategy in enumerate(args.strategy):
            _say(f"kvxferd: prefill and decode daemons, transfer.strategy = {strategy} ...")
            (workdir / strategy).mkdir(parents=True, exist_ok=True)
            try:
                got = measure_daemons(
                    workload,
                    rows_by[strategy],
                    args,
                    workdir / strategy,
                    strategy=strategy,
                    latency_pulls=None if i == 0 else 0,
                )
            except (BenchFailure, DaemonError, RpcFailure) as exc:
                # This strategy's rows say why; the other strategies are still measured.
                error = error or f"{strategy}: {exc}"
                for c in rows_by[strategy]:
                    c.failed = c.failed or str(exc)
                _say(f"  {strategy} FAILED: {exc}")
                continue
            latency = latency or got
        # The raw copy once more, now that every other row ran (clocks and caches as warm as
        # theirs): the better pass is the raw copy, so no row of this run can beat it.
        _say("raw copy limit, second pass ...")
        again = [Cell(b.tokens, b.pattern, b.blocks, b.nbytes) for b in base]
        measure_limit(workload, again, args.repeat)
        for b, a in zip(base, again, strict=True):
            if a.median("limit_gbps") > b.median("limit_gbps"):
                b.limit_gbps, b.limit_how = a.limit_gbps, a.limit_how
        _share(base, rows_by)
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
    print(results_table(cells, args.strategy))
    print(
        "\nraw copy: torch copy_ of the same bytes (the faster of one copy and one per layer);"
        " naive: one NIXL descriptor per (layer, block); floor: the descriptors DIRECT posts,"
        " one READ by a bare NIXL agent in a post/poll loop; kvxferd <strategy>: <what ran>:"
        " StartPull to terminal status on WatchTransfers through two daemons; x raw / x naive:"
        " the row's median over theirs; transport: what served the row (for NIXL rows inferred"
        " from a READ's rate: kvxferd.ipc.transport)"
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
        if latency.get("stages_p50_ms"):
            parts = ", ".join(f"{k} {v:.2f}" for k, v in latency["stages_p50_ms"].items())
            print(f"  where the daemon's time went (p50 per stage, ms): {parts}")
    for strategy in args.strategy:
        failed = next((c.failed for c in rows_by[strategy] if c.failed), "")
        if failed:
            print(f"kvxferd {strategy} failed: {failed}")
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
