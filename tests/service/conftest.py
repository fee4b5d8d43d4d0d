"""Real daemons (``kvxferd serve`` subprocesses) on 127.0.0.1:0 with owned DRAM pools.

Started through :mod:`kvxferd.scenario.daemons`, the launcher the demo uses.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvxferd.scenario.daemons import DaemonOptions, DaemonSet


@dataclass(frozen=True)
class Daemon:
    """Where one started daemon serves."""

    grpc: str
    engine_socket: str
    metrics: str
    alive: object  # () -> bool
    log: Path  # its stdout and stderr (JSON log lines)


@dataclass
class Daemons:
    """Daemons started together; ``stop()`` asserts each exits 0 on SIGTERM."""

    set: DaemonSet

    def __getitem__(self, name: str) -> Daemon:
        d = self.set[name]
        assert d.ready is not None
        return Daemon(d.ready.grpc, d.ready.engine_socket, d.ready.metrics, d.alive, d.log_path)

    def stop(self) -> None:
        self.set.stop()
        problems = self.set.stop_problems()
        assert not problems, problems


def raw_exchange(path: str, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection to the Unix socket at ``path`` and read until the
    daemon answers one frame (kvxferd/wire/local.py) or closes the connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(data)
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return got
            got += chunk
            if len(got) >= 9 and len(got) >= 9 + int.from_bytes(got[:4], "big"):
                return got


def launch(tmp: Path, *options: DaemonOptions) -> Daemons:
    with_metrics = [
        dataclasses.replace(o, extra=(*o.extra, "--metrics-listen", "127.0.0.1:0")) for o in options
    ]
    daemons = DaemonSet(tmp, with_metrics)
    try:
        daemons.start()
        daemons.wait_ready()
    except BaseException:
        daemons.stop()
        raise
    return Daemons(daemons)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    """A prefill daemon (pattern-filled) and a decode daemon, dense preset, 64 blocks each."""
    ds = launch(
        tmp_path_factory.mktemp("pair"),
        DaemonOptions("prefill", "dense:num_blocks=64", fill_seed=3),
        DaemonOptions("decode", "dense:num_blocks=64"),
    )
    yield ds["prefill"], ds["decode"]
    ds.stop()
