"""A helper process for tests that prints JSON lines: started with ``python -m MODULE --socket
PATH ...`` from the repository root, read on a thread, killed for good at the end."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


class LineProcess:
    """``python -m module --socket socket *args``; its stderr goes to a file beside the
    socket, quoted when it says nothing in time."""

    LINE_TIMEOUT_S = 60.0

    def __init__(
        self, module: str, socket: str, *args: str, env: dict[str, str] | None = None
    ) -> None:
        tag = module.rsplit(".", 1)[-1]
        self.err = Path(socket).with_suffix(f".{tag}-{os.getpid()}-{time.monotonic_ns()}.err")
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, "--socket", socket, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                cwd=ROOT,
                text=True,
            )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def line(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The next JSON line; AssertionError with the stderr's tail if none comes in time."""
        try:
            got = self._lines.get(timeout=timeout_s or self.LINE_TIMEOUT_S)
        except queue.Empty:
            self.kill()
            tail = self.err.read_text()[-3000:]
            raise AssertionError(f"{self.proc.args[2]} printed nothing; stderr:\n{tail}") from None
        return dict(json.loads(got))

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None and not f.closed:
                with contextlib.suppress(OSError):
                    f.close()
