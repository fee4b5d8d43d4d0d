"""One vLLM engine (offline ``LLM`` API, engine core in this process) driven over stdin/stdout.

``python -m kvxferd.vllm.engine_proc --model DIR --connector kvxferd|nixl|none --role ...``
starts the engine, prints ``{"op": "ready", ...}`` and then answers one JSON line per command:

* ``{"op": "generate", "requests": [{"id", "tokens", "max_tokens", "kv_transfer_params"}]}``
  -> ``{"op": "result", "outputs": [{"id", "tokens", "kv_transfer_params", "ttft_s"}]}``
  (greedy; ``ttft_s`` is vLLM's own first-token latency of the request in this engine);
* ``{"op": "quit"}`` -> shuts the engine down and exits 0.

Used by ``kvxferd demo --engine vllm`` (docs/vllm.md): the demo plays vLLM's disaggregated
proxy between a prefill and a decode engine process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

_OUT: list[Any] = [sys.stdout]  # the protocol's stream (vLLM's own output goes to stderr)


def _say(doc: dict[str, Any]) -> None:
    _OUT[0].write(json.dumps(doc) + "\n")
    _OUT[0].flush()


def _transfer_config(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.connector == "none":
        return None
    if args.connector == "kvxferd":
        return {
            "kv_connector": "KvxferdConnector",
            "kv_connector_module_path": "kvxferd.vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"engine_socket": args.engine_socket},
        }
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if args.role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu",
    }


def _amx_off() -> None:
    """Make this process's vLLM choose its AVX-512 CPU attention over its AMX one.

    vLLM 0.32's CPU attention takes its AMX kernel for bf16 caches whenever
    ``torch.cpu._is_amx_tile_supported()`` says so. On the 2-core VMs where this demo and its CI
    test run (Xeon with amx_bf16/amx_tile), the kvxferd decode engine then died with SIGILL
    (exit status -4) right after its first pull, on 2026-11-27 and at older commits alike; with
    the AMX kernel off the whole demo passed (tokens identical, control, NixlConnector beside
    it). The demo compares outputs, not attention kernels, so it runs the portable kernel.
    Workers that vLLM spawns in processes of their own (``--tp`` > 1) import torch afresh and
    are not covered."""
    import torch.cpu

    torch.cpu._is_amx_tile_supported = lambda: False


def _abort(
    engine: Any, reqs: list[dict[str, Any]], prompts: list[Any], params: list[Any]
) -> list[str]:
    """Add each request and abort it before the engine schedules it (the engine core runs in
    this process, so nothing runs in between), as a client that goes away while its request
    waits; then run a few engine steps, which hand the connector's metadata to the worker."""
    ids = [
        engine.add_request(r["id"], p, sp) for r, p, sp in zip(reqs, prompts, params, strict=True)
    ]
    engine.abort_request(ids, internal=True)
    for _ in range(3):
        engine.step()
    return ids


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--connector", choices=("none", "kvxferd", "nixl"), default="none")
    ap.add_argument("--role", choices=("single", "prefill", "decode"), default="single")
    ap.add_argument("--engine-socket", default="")
    ap.add_argument("--num-blocks", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor_parallel_size (workers in processes of their own; with the kvxferd"
        " connector --engine-socket holds {rank}: one daemon per rank, docs/vllm.md)",
    )
    ap.add_argument(
        "--amx",
        choices=("off", "auto"),
        default="off",
        help="off (default): vLLM's CPU attention runs its AVX-512 kernels even where torch"
        " reports AMX tiles; auto: vLLM picks (see _amx_off)",
    )
    args = ap.parse_args()
    if args.amx == "off":
        _amx_off()
    # vLLM logs to stdout; keep stdout for the protocol.
    _OUT[0] = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kvt = _transfer_config(args)
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.3,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_gpu_blocks_override=args.num_blocks,
        enable_prefix_caching=True,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
        kv_transfer_config=KVTransferConfig(**kvt) if kvt else None,
        tensor_parallel_size=args.tp,
        **({"distributed_executor_backend": "mp"} if args.tp > 1 else {}),
    )
    _say({"op": "ready", "startup_s": time.monotonic() - t0, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        reqs = cmd["requests"]
        prompts = [TokensPrompt(prompt_token_ids=list(r["tokens"])) for r in reqs]
        params = []
        for r in reqs:
            sp = SamplingParams(max_tokens=int(r["max_tokens"]), temperature=0.0, detokenize=False)
            if r.get("kv_transfer_params") is not None:
                sp.extra_args = {"kv_transfer_params": r["kv_transfer_params"]}
            params.append(sp)
        if cmd.get("op") == "abort":
            _say({"op": "aborted", "ids": _abort(llm.llm_engine, reqs, prompts, params)})
            continue
        outs = llm.generate(prompts, params, use_tqdm=False)
        result = []
        for r, o in zip(reqs, outs, strict=True):
            m = o.metrics
            ttft = getattr(m, "first_token_latency", None) if m is not None else None
            result.append(
                {
                    "id": r["id"],
                    "tokens": list(o.outputs[0].token_ids),
                    "kv_transfer_params": o.kv_transfer_params,
                    "ttft_s": ttft,
                    "finish_reason": o.outputs[0].finish_reason,
                }
            )
        _say({"op": "result", "outputs": result})
    del llm
    _say({"op": "bye"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
