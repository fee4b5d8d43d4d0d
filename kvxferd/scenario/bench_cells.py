"""What ``kvxferd bench`` measures: the workload (the dense Llama-3-8B-shaped pool, the block
IDs of every (size, pattern, repeat), the same for every row), one :class:`Cell` of results per
(size, pattern, strategy), and the one table they print as.
"""

from __future__ import annotations

import math
import statistics
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxferd.errors import KvxferdError
from kvxferd.layout import preset
from kvxferd.layout.spec import KVCacheSpec
from kvxferd.scenario.mix import CONTIGUOUS, Int64Array
from kvxferd.scenario.naive import PoolShape
from kvxferd.scenario.report import fmt, human_bytes, table

CPU_SIZES = (256, 1024, 4096, 8192)
GPU_SIZES = (256, 1024, 4096, 8192, 32768)
SMALL_BLOCKS = 16
WARMUP_REP = 999_999  # block_ids() rep index of the warm-up pulls


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
    stage_seconds: dict[str, list[float]] = field(default_factory=dict)  # status stages

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


def ratio(x: float, base: float) -> str:
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
            x_raw, x_naive = ratio(gbps, raw), ratio(gbps, naive)
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


def share_baselines(base: list[Cell], rows_by: dict[str, list[Cell]]) -> None:
    """Copy the raw, naive and floor figures of each base cell to every strategy's row."""
    for cells in rows_by.values():
        for row, b in zip(cells, base, strict=True):
            if row is b:
                continue
            row.limit_gbps, row.limit_how = b.limit_gbps, b.limit_how
            row.naive_gbps, row.naive_descriptors = b.naive_gbps, b.naive_descriptors
            row.floor_gbps, row.floor_descriptors = b.floor_gbps, b.floor_descriptors
            row.nixl_transport = b.nixl_transport
