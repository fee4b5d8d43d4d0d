"""A vLLM-shaped GPU engine for the connector's GPU tests, without vLLM.

Run as ``python -m tests.vllm.gpu_engine --socket PATH [--layout LBHNC] [--seed S]``. It
allocates a KV cache on cuda:0 the way vLLM 0.32's worker does (one ``torch.zeros`` int8
buffer rounded up to 4 KiB, one bf16 ``[B, H, N, C]`` view per layer in the layout's order;
``vllm/v1/worker/utils.py`` ``allocate_kv_cache`` and ``create_kv_cache_views``), fills it with
random bytes, and attaches it through the connector's own GPU path
(:func:`kvxferd.vllm.gpu.attach_cuda`). It prints ``{"attached": ...}`` and then answers one
JSON command per stdin line, with one JSON line each, through the connector's daemon links:

* ``{"op": "hold", "request_id": R, "blocks": [...]}``: ``EngineLink.hold`` (the prefill side);
* ``{"op": "pull", "ticket": {...}, "local": [...]}``: ``PullLink.start`` on this engine's own
  daemon, waited to its terminal state (the decode side);
* ``{"op": "detach"}``: close the session and exit.

A refused attach prints ``{"error": "..."}`` and exits 3.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
from typing import Any

import torch

from kvxferd.vllm.daemon import EngineLink, Release
from kvxferd.vllm.gpu import attach_cuda
from kvxferd.vllm.pull_link import PullLink, PullResult
from tests.vllm.test_vllm_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

NUM_BLOCKS, TOKENS, HEADS, HEAD_SIZE = 64, 16, 4, 64
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "BLNHC": (1, 0, 3, 2, 4)}


def vllm_kv_cache(layout: str, device: str) -> tuple[KVCacheConfig, torch.Tensor, dict[str, Any]]:
    """vLLM 0.32's KV cache config, backing buffer and per-layer views for ``layout``."""
    spec = FullAttentionSpec(TOKENS, HEADS, HEAD_SIZE, torch.bfloat16)
    shape = (len(LAYERS), NUM_BLOCKS, HEADS, TOKENS, 2 * HEAD_SIZE)  # [L, B, H, N, C] elements
    strides = [0] * 5
    step = 1
    for dim in reversed(ORDERS[layout]):
        strides[dim] = step
        step *= shape[dim]
    es = 2
    tensor = KVCacheTensor(step * es, list(LAYERS), strides[0] * es, strides[1] * es)
    cfg = KVCacheConfig(NUM_BLOCKS, [tensor], [KVCacheGroupSpec(list(LAYERS), spec)], layout)
    raw = torch.zeros((step * es + 4095) // 4096 * 4096, dtype=torch.int8, device=device)
    full = raw.view(torch.bfloat16).as_strided(shape, strides)
    return cfg, raw, {name: full[i] for i, name in enumerate(LAYERS)}


def _say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--layout", default="LBHNC", choices=sorted(ORDERS))
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    cfg, raw, views = vllm_kv_cache(args.layout, "cuda:0")
    gen = torch.Generator(device="cuda:0").manual_seed(args.seed)
    raw.random_(-128, 127, generator=gen)  # the "model" computed this cache
    torch.cuda.synchronize()
    link = EngineLink(args.socket)

    def released(rel: Release) -> None:
        _say({"released": rel.request_id, "reason": rel.reason})

    try:
        done = attach_cuda(
            link,
            cfg,
            views,
            model="tiny-gpu",
            layout=args.layout,
            backend="FLASH_ATTN",
            prefix_caching=False,
            wait_s=30.0,
            on_release=released,
        )
    except RuntimeError as err:
        _say({"error": str(err)})
        return 3
    _say(
        {
            "attached": {
                "peer_address": done.pool.peer_address,
                "model": done.described.spec.model,
                "regions": [r.describe() for r in done.described.spec.regions],
            }
        }
    )
    pull = PullLink(done.pool.peer_address)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "hold":
            resp = link.hold(cmd["request_id"], [cmd["blocks"]], readers=1, ttl_ms=0)
            _say(
                {
                    "ticket": {
                        "peer_address": resp.peer_address,
                        "request_id": resp.request_id,
                        "remote": [cmd["blocks"]],
                    }
                }
            )
        elif cmd["op"] == "pull":
            t = cmd["ticket"]
            results: queue.Queue[PullResult] = queue.Queue()
            pull.start(
                f"gpu-{t['request_id']}",
                t["request_id"],
                t["peer_address"],
                t["remote"],
                [cmd["local"]],
                deadline_ms=30_000,
                on_done=results.put,
            )
            r = results.get(timeout=60)
            _say({"pulled": {"transfer_id": r.transfer_id, "state": r.state, "error": r.error}})
        elif cmd["op"] == "detach":
            pull.close()
            link.close()
            _say({"detached": True})
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
