"""Start-up fails closed and clearly: real ``kvxferd serve`` processes.

A refused start is exit status 2 with one ``kvxferd: error:`` line naming the key and the fix
(no traceback), before any memory is registered. Each case here started, or crashed with a
traceback, before the fix (issue 11, items 2 and 8).
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvxferd.scenario.daemons import DaemonOptions, socket_path
from tests.service.conftest import Daemon, launch

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Outcome:
    started: bool
    returncode: int | None
    stderr: str


def serve(tmp: Path, *args: str, env: dict[str, str] | None = None) -> Outcome:
    """Run ``kvxferd serve`` (small DRAM pool, loopback, metrics off unless ``args`` say
    otherwise) until it exits or writes its ready file; a started daemon is stopped."""
    ready = tmp / "ready.json"
    ready.unlink(missing_ok=True)
    errors = tmp / "stderr.txt"
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVXFERD_")}
    cmd = [
        sys.executable,
        "-m",
        "kvxferd",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--preset",
        "dense:num_blocks=4",
        "--metrics-listen",
        "",
        "--set",
        "transfer.staging_chunks=0",
        "--ready-file",
        str(ready),
        *args,
    ]
    with open(errors, "wb") as err:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**base, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        deadline = time.monotonic() + 120
        while proc.poll() is None and not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        started = ready.exists()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return Outcome(started, None if started else proc.returncode, errors.read_text())


def refused(tmp: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """The one error line of a start that must be refused (exit 2, no traceback)."""
    out = serve(tmp, *args, env=env)
    assert not out.started, f"the daemon started although it must refuse:\n{out.stderr}"
    assert out.returncode == 2, f"exit status {out.returncode}:\n{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("kvxferd: error: ")]
    assert len(errors) == 1, out.stderr
    assert lines == errors, f"more than the one error line on stderr:\n{out.stderr}"
    return errors[0]


def listening_tcp() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


# --- auth fails closed ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("content", ["", "  \n\t\n"])
def test_empty_token_file_is_refused_not_unauthenticated(tmp_path: Path, content: str) -> None:
    token = tmp_path / "token"
    token.write_text(content)
    remote = ("--listen", "0.0.0.0:0", "--set", "auth.allow_plaintext_token=true")
    line = refused(tmp_path, *remote, "--set", f"auth.token_file={token}")
    assert "auth.token_file" in line and "empty" in line and "docs/config.md" in line
    # Loopback too: a configured secret that resolves to nothing is never "no auth".
    line = refused(tmp_path, "--set", f"auth.token_file={token}")
    assert "auth.token_file" in line


@pytest.mark.slow
def test_whitespace_token_is_refused(tmp_path: Path) -> None:
    line = refused(tmp_path, "--listen", "0.0.0.0:0", env={"KVXFERD_AUTH_TOKEN": "   "})
    assert "auth.token" in line and "whitespace" in line


@pytest.mark.slow
def test_plaintext_token_on_a_remote_listener_needs_tls_or_opt_in(tmp_path: Path) -> None:
    line = refused(tmp_path, "--listen", "0.0.0.0:0", "--token", "s3cret")
    assert "auth.token" in line and "auth.allow_plaintext_token" in line
    assert "auth.tls_cert" in line
    out = serve(
        tmp_path,
        "--listen",
        "0.0.0.0:0",
        "--token",
        "s3cret",
        "--set",
        "auth.allow_plaintext_token=true",
    )
    assert out.started, out.stderr


@pytest.mark.slow
def test_remote_metrics_need_an_explicit_opt_in(tmp_path: Path) -> None:
    line = refused(tmp_path, "--metrics-listen", "0.0.0.0:0")
    assert "server.metrics_listen" in line and "server.metrics_allow_remote" in line
    out = serve(
        tmp_path, "--metrics-listen", "0.0.0.0:0", "--set", "server.metrics_allow_remote=true"
    )
    assert out.started, out.stderr


# --- the Engine socket ------------------------------------------------------------------


@pytest.mark.slow
def test_engine_socket_never_replaces_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "engine.sock"
    path.write_text("precious")
    line = refused(tmp_path, "--engine-socket", str(path))
    assert "server.engine_socket" in line and "regular file" in line
    assert path.read_text() == "precious"


@pytest.mark.slow
def test_engine_socket_of_a_live_listener_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "engine.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(path))
        other.listen()
        line = refused(tmp_path, "--engine-socket", str(path))
        assert "server.engine_socket" in line and "listens" in line
        assert stat.S_ISSOCK(path.lstat().st_mode)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(str(path))  # still the other process's socket


@pytest.fixture(scope="module")
def stale_socket_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon started where a dead daemon left its Engine socket behind."""
    tmp = tmp_path_factory.mktemp("stale")
    path = socket_path(tmp, "d")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))  # closed without unlink: a stale socket file remains
    assert stat.S_ISSOCK(path.lstat().st_mode)
    ds = launch(tmp, DaemonOptions("d", "dense:num_blocks=4"))
    yield ds["d"]
    ds.stop()


def test_stale_engine_socket_is_replaced_and_owner_group_only(stale_socket_daemon: Daemon) -> None:
    path = Path(stale_socket_daemon.engine_socket)
    mode = stat.S_IMODE(path.lstat().st_mode)
    assert mode == 0o660, oct(mode)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.connect(str(path))  # the new daemon serves there


# --- ports and addresses ----------------------------------------------------------------


def test_grpc_port_in_use_is_one_line_naming_port_and_key(tmp_path: Path) -> None:
    sock, port = listening_tcp()
    with sock:
        line = refused(tmp_path, "--listen", f"127.0.0.1:{port}")
    assert "server.listen" in line and f"port {port} is already in use" in line


def test_second_daemon_on_the_same_grpc_port_is_refused(
    tmp_path: Path, stale_socket_daemon: Daemon
) -> None:
    """gRPC's default SO_REUSEPORT let a second daemon bind the first one's port."""
    port = stale_socket_daemon.grpc.rpartition(":")[2]
    line = refused(tmp_path, "--listen", f"127.0.0.1:{port}")
    assert "server.listen" in line and f"port {port}" in line


def test_metrics_port_in_use_is_refused_before_memory_is_registered(tmp_path: Path) -> None:
    sock, port = listening_tcp()
    with sock:
        line = refused(tmp_path, "--metrics-listen", f"127.0.0.1:{port}")
    assert "server.metrics_listen" in line and f"port {port} is already in use" in line


@pytest.mark.parametrize("listen", ["127.0.0.1:99999", "127.0.0.1:65536", "::1:50051"])
def test_bad_listen_addresses_are_refused(tmp_path: Path, listen: str) -> None:
    line = refused(tmp_path, "--listen", listen)
    assert "server.listen" in line


# --- flags and environment --------------------------------------------------------------


@pytest.mark.parametrize("item", ["foo", "=1", "transfer.max_inflight"])
def test_set_without_equals_is_a_clear_error(tmp_path: Path, item: str) -> None:
    line = refused(tmp_path, "--set", item)
    assert "--set" in line and "SECTION.KEY=VALUE" in line


def test_misspelled_environment_variable_names_the_closest_key(tmp_path: Path) -> None:
    line = refused(tmp_path, env={"KVXFERD_SERVER_LISTN": "0.0.0.0:1"})
    assert "KVXFERD_SERVER_LISTN" in line and "KVXFERD_SERVER_LISTEN" in line
    assert "docs/config.md" in line


def test_bad_peer_allow_entry_is_refused(tmp_path: Path) -> None:
    line = refused(tmp_path, "--set", "peers.allow=10.0.0.0/8,10.1.2.3/16")
    assert "peers.allow" in line and "10.1.0.0/16" in line
