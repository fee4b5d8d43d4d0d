"""Data-plane benchmark: one 1 GiB Llama-3-8B-shaped request between two processes on CPU.

Run from the repository root: ``python -m bench.dataplane``.

Shape: 32 layers, per-layer tensor ``(num_blocks, 2, 16, 8, 128)`` bf16, so one block of one
layer is 64 KiB; the request reads 512 blocks per layer (1 GiB). An owner process
(kvxferd.scenario.owner) holds the pool; this process reads it with kvxferd's TransferEngine
over NIXL/UCX loopback.

Rows (median of ``--repeat`` runs, one table, also written as JSON):
  memcpy        torch ``copy_`` of the same bytes inside this process: the limit
  naive         one descriptor per (layer, block), random blocks: the vLLM-connector scheme
  coalesced     contiguous blocks, merged to one descriptor per layer
  fragmented    random blocks, merged where runs happen to touch
Every NIXL row is checked: sampled (layer, block) pairs must hold the owner's pattern.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from kvxferd.nixl import AgentOptions, MemType, NixlAgent
from kvxferd.scenario.naive import per_block_plan
from kvxferd.scenario.owner import OwnerProcess, OwnerSpec
from kvxferd.scenario.pattern import pattern_words
from kvxferd.transfer import EngineOptions, TransferEngine, TransferStatus

LAYERS = 32
BLOCK_SHAPE = (2, 16, 8, 128)  # K/V, tokens, kv heads, head dim
BLOCK_BYTES = 2 * 16 * 8 * 128 * 2  # bf16: 64 KiB
REQ_BLOCKS = 512


def _verify(
    bufs: list[torch.Tensor],
    local: np.ndarray,
    remote: np.ndarray,
    *,
    seed: int,
    rng: np.random.Generator,
    samples: int = 128,
) -> None:
    words = BLOCK_BYTES // 8
    for _ in range(samples):
        layer = int(rng.integers(LAYERS))
        i = int(rng.integers(local.size))
        got = bufs[layer].view(torch.uint8).view(-1).view(torch.int64)
        lb, rb = int(local[i]), int(remote[i])
        chunk = got[lb * words : (lb + 1) * words].numpy()
        if not np.array_equal(chunk, pattern_words(seed, layer, rb * words, words)):
            raise AssertionError(f"layer {layer} block {lb} does not hold remote block {rb}")


def _memcpy_gbps(bufs: list[torch.Tensor], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for b in bufs:  # same bytes: 512 blocks per layer, copied within the layer's tensor
            b[REQ_BLOCKS : 2 * REQ_BLOCKS].copy_(b[:REQ_BLOCKS])
        out.append(LAYERS * REQ_BLOCKS * BLOCK_BYTES / (time.perf_counter() - t0) / 1e9)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-blocks", type=int, default=1024, help="pool blocks per layer (>=1024)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="also write results here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ucx-threads", type=int, default=0, help="UCX backend num_threads")
    ap.add_argument(
        "--max-desc-kib", type=int, default=0, help="split merged ranges above this size (0: never)"
    )
    args = ap.parse_args(argv)
    nb = args.num_blocks
    if nb < 2 * REQ_BLOCKS:
        ap.error("--num-blocks must be at least 1024")
    layer_bytes = nb * BLOCK_BYTES
    owner = OwnerProcess(OwnerSpec("bench-owner", (layer_bytes,) * LAYERS, seed=3))
    agent = NixlAgent("bench-reader", options=AgentOptions(num_threads=args.ucx_threads))
    agent.start()
    bufs = [torch.zeros((nb, *BLOCK_SHAPE), dtype=torch.bfloat16) for _ in range(LAYERS)]
    regions = np.array([[b.data_ptr(), layer_bytes, 0] for b in bufs], dtype=np.int64)
    agent.register(regions, MemType.DRAM)
    engines = {
        True: TransferEngine(
            agent,
            regions,
            options=EngineOptions(
                default_timeout_s=120, max_desc_bytes=(args.max_desc_kib << 10) or None
            ),
        ),
        False: TransferEngine(
            agent, regions, options=EngineOptions(default_timeout_s=120, coalesce=False)
        ),
    }
    for e in engines.values():
        e.start()
    engines[True].connect_peer(owner.name, owner.metadata, owner.regions)
    engines[False].connect_peer(owner.name, owner.metadata, owner.regions)
    rng = np.random.default_rng(args.seed)
    rows: dict[str, dict[str, float | int]] = {}
    try:
        memcpy = _memcpy_gbps(bufs, args.repeat)
        rows["memcpy (torch copy_)"] = {"gbps": statistics.median(memcpy), "descriptors": 0}
        contiguous = np.arange(REQ_BLOCKS, dtype=np.int64)
        schemes = [
            ("naive: 1 desc per (layer, block)", False, "random"),
            ("coalesced: contiguous blocks", True, "contiguous"),
            ("fragmented: random blocks", True, "random"),
        ]
        warm = per_block_plan(contiguous[:2], contiguous[:2], num_layers=1, block_bytes=BLOCK_BYTES)
        engines[True].submit("warm", owner.name, warm).result(60)
        n = 0
        for label, merge, pattern in schemes:
            speeds, posts, descs = [], [], 0
            for _ in range(args.repeat):
                if pattern == "contiguous":
                    local = remote = contiguous
                else:
                    local = np.sort(rng.choice(nb, REQ_BLOCKS, replace=False)).astype(np.int64)
                    remote = rng.permutation(rng.choice(nb, REQ_BLOCKS, replace=False))
                plan = per_block_plan(local, remote, num_layers=LAYERS, block_bytes=BLOCK_BYTES)
                n += 1
                t0 = time.perf_counter()
                res = engines[merge].submit(f"x{n}", owner.name, plan).result(120)
                dt = time.perf_counter() - t0
                if res.status is not TransferStatus.DONE:
                    raise RuntimeError(f"{label}: {res.status.value} {res.reason}")
                _verify(bufs, local, remote, seed=3, rng=rng)
                speeds.append(res.nbytes / dt / 1e9)
                posts.append((res.post_us or 0) / 1e3)
                descs = res.descriptors
            rows[label] = {
                "gbps": statistics.median(speeds),
                "descriptors": descs,
                "post_ms": statistics.median(posts),
            }
    finally:
        for e in engines.values():
            e.close()
        agent.close()
        owner.close()
    base = rows["memcpy (torch copy_)"]["gbps"]
    naive = rows["naive: 1 desc per (layer, block)"]["gbps"]
    print(
        f"1 GiB request ({LAYERS} layers x {REQ_BLOCKS} blocks x 64 KiB), CPU DRAM, "
        f"UCX loopback, median of {args.repeat}"
    )
    print(f"{'scheme':36} {'descs':>7} {'post ms':>8} {'GB/s':>7} {'x memcpy':>9} {'x naive':>8}")
    for label, r in rows.items():
        post = f"{r['post_ms']:.1f}" if "post_ms" in r else "-"
        print(
            f"{label:36} {r['descriptors']:>7} {post:>8} {r['gbps']:>7.2f} "
            f"{r['gbps'] / base:>9.2f} {r['gbps'] / naive:>8.2f}"
        )
    result = {
        "request_bytes": LAYERS * REQ_BLOCKS * BLOCK_BYTES,
        "repeat": args.repeat,
        "rows": rows,
    }
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
