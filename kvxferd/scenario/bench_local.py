"""The rows of ``kvxferd bench`` measured without daemons: the raw copy of the same bytes (the
limit), and the naive scheme and the bare-NIXL floor between two processes with raw NIXL agents
(:mod:`kvxferd.scenario.naive`), the same block IDs for both and verified on a sample.
"""

from __future__ import annotations

import gc
import math
import secrets
import statistics
import time
from typing import Any

from kvxferd.scenario.bench_cells import WARMUP_REP, Cell, Workload, block_ids
from kvxferd.scenario.mix import CONTIGUOUS, Int64Array
from kvxferd.scenario.naive import NaiveReader, naive_owner
from kvxferd.scenario.puller import VERIFY_SAMPLES, BenchFailure, say

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
    owner = naive_owner(f"kvxferd-bench-owner-{tag}", workload.shape, workload.dev_prefill)
    try:
        reader = NaiveReader(
            f"kvxferd-bench-reader-{tag}", workload.shape, workload.dev_decode, owner
        )
        try:
            warm = block_ids(workload, 256, CONTIGUOUS, WARMUP_REP, seed)
            reader.pull(*warm)  # warm-up: UCX connects and maps
            reader.floor(*warm)
            for cell in cells:
                say(f"  naive    {cell.tokens:>6} tokens {cell.pattern} (and the floor)")
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
