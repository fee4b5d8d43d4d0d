"""Real daemons (``kvxferd serve`` subprocesses) on 127.0.0.1:0 with owned DRAM pools."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    grpc: str
    engine_socket: str
    metrics: str
    log: Path

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(5)


def launch(tmp: Path, name: str, *args: str) -> Daemon:
    ready = tmp / f"{name}.ready"
    log = tmp / f"{name}.log"
    sock = tmp / f"{name}.sock"
    cmd = [
        sys.executable, "-m", "kvxferd", "serve", "--listen", "127.0.0.1:0",
        "--engine-socket", str(sock), "--metrics-listen", "127.0.0.1:0",
        "--ready-file", str(ready), "--log-format", "text", *args,
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"daemon {name} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return Daemon(proc, info["grpc"], info["engine_socket"], info["metrics"], log)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    """A prefill daemon (pattern-filled) and a decode daemon, dense preset, 64 blocks each."""
    tmp = tmp_path_factory.mktemp("pair")
    prefill = launch(tmp, "prefill", "--preset", "dense:num_blocks=64", "--fill-pattern", "3")
    decode = launch(tmp, "decode", "--preset", "dense:num_blocks=64")
    yield prefill, decode
    assert decode.stop() == 0, decode.log.read_text()[-2000:]
    assert prefill.stop() == 0, prefill.log.read_text()[-2000:]
