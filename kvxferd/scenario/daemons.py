"""Start ``kvxferd serve`` processes for demos and benchmarks, wait for them, always stop them.

Each daemon is ``sys.executable -m kvxferd serve`` listening on ``127.0.0.1:0``, with its
engine socket and ready file in a work directory and its output in a log file there. On Linux
a daemon also gets ``PR_SET_PDEATHSIG`` (set by a tiny exec wrapper, not by ``preexec_fn``,
which is unsafe once threads run), so it is terminated even if this process is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

# Run as: python -c WRAPPER PARENT_PID python -m kvxferd serve ...
_PDEATHSIG_WRAPPER = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)  # the parent died before prctl took effect
os.execv(sys.argv[2], sys.argv[2:])
"""
SOCKET_PATH_MAX = 100  # sun_path is 108 bytes; keep a margin
READY_TIMEOUT_S = 120.0
STOP_GRACE_S = 20.0


class DaemonError(Exception):
    """A daemon did not start, died, or did not stop; the message carries its output's tail."""


@dataclass(frozen=True)
class DaemonOptions:
    """What one daemon runs with (flags of ``kvxferd serve``)."""

    name: str
    preset: str
    device: str = "cpu"
    prefix_caching: bool = False
    fill_seed: int | None = None
    token: str = ""
    extra: tuple[str, ...] = ()
    scheduler_socket: bool = False  # also serve server.scheduler_socket (<name>.sched.sock)

    def argv(self, workdir: Path) -> list[str]:
        args = [
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--preset",
            self.preset,
            "--device",
            self.device,
            "--engine-socket",
            str(socket_path(workdir, self.name)),
            "--metrics-listen",
            "",
            "--ready-file",
            str(workdir / f"{self.name}.ready.json"),
        ]
        if self.prefix_caching:
            args.append("--prefix-caching")
        if self.fill_seed is not None:
            args += ["--fill-pattern", str(self.fill_seed)]
        if self.token:
            args += ["--token", self.token]
        if self.scheduler_socket:
            args += ["--set", f"server.scheduler_socket={workdir / f'{self.name}.sched.sock'}"]
        return [*args, *self.extra]


def socket_path(workdir: Path, name: str) -> Path:
    return workdir / f"{name}.sock"


@dataclass(frozen=True)
class Ready:
    """The daemon's ready file: where it serves."""

    grpc: str
    engine_socket: str
    metrics: str
    pid: int
    peer_socket: str = ""  # the same-host Peer socket (peers.local_socket), "" when off
    scheduler_socket: str = ""  # server.scheduler_socket, "" when off


@dataclass
class Daemon:
    options: DaemonOptions
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    ready: Ready | None = None
    returncode: int | None = None
    signalled: bool = False  # alive when stop() sent SIGTERM
    reported: bool = False  # its death was already raised as a DaemonError
    killed: bool = False
    _log: Path = field(init=False)

    def __post_init__(self) -> None:
        self._log = self.workdir / f"{self.options.name}.log"

    @property
    def name(self) -> str:
        return self.options.name

    @property
    def log_path(self) -> Path:
        return self._log

    @property
    def ready_path(self) -> Path:
        return self.workdir / f"{self.name}.ready.json"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "kvxferd", *self.options.argv(self.workdir)]
        if sys.platform.startswith("linux"):
            return [sys.executable, "-c", _PDEATHSIG_WRAPPER, str(os.getpid()), *cmd]
        return cmd

    def start(self, env: dict[str, str] | None = None) -> None:
        if self.proc is not None:
            raise DaemonError(f"daemon {self.name} was already started")
        sock = socket_path(self.workdir, self.name)
        if len(str(sock)) > SOCKET_PATH_MAX:
            raise DaemonError(
                f"engine socket path {sock} is longer than {SOCKET_PATH_MAX} bytes;"
                " set TMPDIR to a shorter directory"
            )
        with contextlib.suppress(FileNotFoundError):
            self.ready_path.unlink()
        with open(self._log, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # Ctrl-C reaches us; we stop the daemons in order
            )

    def poll_ready(self) -> Ready | None:
        """The ready file once written (atomically by the daemon), else None."""
        if self.ready is not None:
            return self.ready
        try:
            doc = json.loads(self.ready_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise DaemonError(f"daemon {self.name}: unreadable ready file: {exc}") from exc
        try:
            self.ready = Ready(
                grpc=str(doc["grpc"]),
                engine_socket=str(doc.get("engine_socket") or ""),
                metrics=str(doc.get("metrics") or ""),
                pid=int(doc.get("pid") or 0),
                peer_socket=str(doc.get("peer_socket") or ""),
                scheduler_socket=str(doc.get("scheduler_socket") or ""),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DaemonError(f"daemon {self.name}: ready file lacks {exc}: {doc}") from exc
        return self.ready

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 25) -> str:
        try:
            text = self._log.read_text(errors="replace")
        except OSError:
            return "(no output)"
        return "\n".join(text.rstrip().splitlines()[-lines:]) or "(no output)"

    def describe_death(self) -> str:
        code = self.proc.poll() if self.proc is not None else None
        how = f"exited with status {code}" if code is not None else "is not running"
        cmd = shlex.join(self.options.argv(self.workdir))
        return (
            f"daemon {self.name} {how} (kvxferd {cmd})\n"
            f"--- last lines of {self._log} ---\n{self.tail()}\n---"
        )


class DaemonSet:
    """Several daemons started together; a context manager that always stops them."""

    def __init__(self, workdir: Path, options: Sequence[DaemonOptions]) -> None:
        names = [o.name for o in options]
        if len(set(names)) != len(names):
            raise ValueError(f"daemon names must be unique: {names}")
        self.workdir = workdir
        self.daemons = {o.name: Daemon(o, workdir) for o in options}

    def __getitem__(self, name: str) -> Daemon:
        return self.daemons[name]

    def __iter__(self) -> Iterator[Daemon]:
        return iter(self.daemons.values())

    def __enter__(self) -> DaemonSet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self, env: dict[str, str] | None = None) -> None:
        for d in self:
            d.start(env)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait until every daemon wrote its ready file; raise DaemonError naming the first
        that died (with its output's tail) or that did not get ready in time."""
        deadline = time.monotonic() + timeout_s
        waiting = list(self)
        while waiting:
            for d in list(waiting):
                if d.poll_ready() is not None:
                    waiting.remove(d)
                elif not d.alive():
                    d.reported = True
                    raise DaemonError(d.describe_death())
            if not waiting:
                break
            if time.monotonic() > deadline:
                d = waiting[0]
                raise DaemonError(
                    f"daemon {d.name} did not become ready within {timeout_s:.0f}s\n"
                    f"--- last lines of {d.log_path} ---\n{d.tail()}\n---"
                )
            time.sleep(0.05)

    def check_alive(self) -> None:
        for d in self:
            if d.proc is not None and not d.alive():
                d.reported = True
                raise DaemonError(d.describe_death())

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every daemon, wait up to ``grace_s`` in all, then SIGKILL the rest."""
        running = [d for d in self if d.proc is not None and d.returncode is None]
        for d in running:
            assert d.proc is not None
            if d.proc.poll() is None:
                d.signalled = True
                with contextlib.suppress(ProcessLookupError):
                    d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for d in running:
            assert d.proc is not None
            try:
                d.returncode = d.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                d.killed = True
                d.proc.kill()
                d.returncode = d.proc.wait()

    def stop_problems(self) -> list[str]:
        """After :meth:`stop`: a line per daemon that was serving and then did not exit 0 on
        SIGTERM, or had died before it (one that never got ready is reported by
        :meth:`wait_ready`; one still starting may die of SIGTERM)."""
        out = []
        for d in self:
            if d.proc is None or d.returncode is None or d.ready is None or d.reported:
                continue
            if not d.signalled:
                out.append(f"while serving: {d.describe_death()}")
            elif d.killed:
                out.append(f"daemon {d.name} did not exit within the grace period; killed")
            elif d.returncode != 0:
                out.append(
                    f"daemon {d.name} exited with status {d.returncode} on SIGTERM\n"
                    f"--- last lines of {d.log_path} ---\n{d.tail()}\n---"
                )
        return out
