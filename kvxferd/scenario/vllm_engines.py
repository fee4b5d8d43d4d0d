"""The processes of ``kvxferd demo --engine vllm``: vLLM engines (a tiny Llama with random
weights, one process each, its lifetime tied to this process), the demo's prompts, and the
arguments and environment each engine role starts with.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvxferd.errors import KvxferdError

DOC = "docs/vllm.md"
BLOCK_SIZE = 32
NUM_BLOCKS = 256
MAX_TOKENS = 12
ENGINE_START_S = 600.0
GENERATE_S = 300.0
DAEMON_EXTRA = (
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


def prompt_tokens(n: int, seed: int) -> list[int]:
    """Deterministic pseudo-random token IDs in [3, 1000)."""
    out, x = [], seed * 2654435761 % (2**32) or 1
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (2**31)
        out.append(3 + x % 997)
    return out


def demo_prompts() -> tuple[list[Prompt], Prompt, Prompt]:
    """The prompts (lengths 7-480, two prefix-cache hits) and the control pair (A, B)."""
    long = prompt_tokens(480, 5)
    p = [
        Prompt("p7", tuple(prompt_tokens(7, 1)), "shorter than a block"),
        Prompt("p40", tuple(prompt_tokens(40, 2))),
        Prompt("p100", tuple(prompt_tokens(100, 3))),
        Prompt("p300", tuple(prompt_tokens(300, 4))),
        Prompt("p480", tuple(long)),
        Prompt(
            "p480+40", tuple(long[:256] + prompt_tokens(40, 6)), "prefix hit: first 256 of p480"
        ),
        Prompt("p100 again", tuple(prompt_tokens(100, 3)), "prefix hit: 96 of 100 cached"),
    ]
    a = prompt_tokens(96, 7)
    b = prompt_tokens(96, 8)
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

    def abort(self, requests: list[dict[str, Any]]) -> list[str]:
        """Add ``requests`` and abort them before they are scheduled (a client gone while its
        request waited); the engine's IDs of them."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "abort", "requests": requests}) + "\n")
        self.proc.stdin.flush()
        return list(self.reply(GENERATE_S)["ids"])

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


def engine_env(bind: str, extra: dict[str, str] | None = None) -> dict[str, str]:
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


def binds() -> tuple[str, str]:
    """CPU cores for the prefill and the decode engine (each pinned to its own if possible)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    return str(cpus[0]), str(cpus[-1])


def engine_args(model: Path, connector: str, role: str, sock: str = "") -> list[str]:
    args = ["--model", str(model), "--connector", connector, "--role", role]
    args += ["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE)]
    return [*args, "--engine-socket", sock] if sock else args


# ---- the decode daemon's transfers ----------------------------------------------------------
