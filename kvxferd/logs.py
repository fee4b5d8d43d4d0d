"""Structured logging: one line per event, JSON or text, configured only by the CLI.

Call sites pass a fixed message and the fields as ``extra=kv(...)`` (request ID, peer,
sizes); the formatter writes them as keys. Importing kvxferd never configures logging.

With the JSON format, :func:`setup_logging` also makes sure nothing else reaches the log
stream as a bare line: NIXL's Python logger (``nixl``, which configures its own stdout
handler) is routed through kvxferd's handler (:func:`adopt`), and whatever native code writes
to file descriptors 1 and 2 (NIXL's and UCX's C++ logging) is read back line by line and
logged as ``kvxferd.native`` records (:class:`NativeCapture`). Python's own ``sys.stdout``
and ``sys.stderr`` keep writing to the real streams (the CLI's one-line ``kvxferd: error:``
stays a plain line).

Values often come from callers (request and transfer IDs, peer addresses), so neither format
lets them forge lines or fields: JSON escapes everything; text escapes control and line-break
characters (``\n`` as ``\\n``, NUL as ``\\x00``, ...) in the message and every value, and
quotes a value holding a space, ``=`` or ``"``. Traceback lines are indented.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import logging
import os
import re
import sys
import threading
import time
from typing import IO, Any

# C0 and C1 controls, DEL, and the Unicode line and paragraph separators.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(m: re.Match[str]) -> str:
    c = m.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def escape(text: str) -> str:
    """``text`` with every control or line-break character written as an escape."""
    return _UNSAFE.sub(_escape_char, text.replace("\\", "\\\\"))


def _text_value(value: Any) -> str:
    text = escape(str(value))
    if not text or any(c in text for c in ' ="'):
        return '"' + text.replace('"', '\\"') + '"'
    return text


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(getattr(record, "kv", {}) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        kv = getattr(record, "kv", {}) or {}
        fields = " ".join(f"{escape(str(k))}={_text_value(v)}" for k, v in kv.items())
        base = (
            f"{self.formatTime(record)} {record.levelname:<7} {record.name}:"
            f" {escape(record.getMessage())}"
        )
        line = f"{base} {fields}" if fields else base
        if record.exc_info:
            trace = self.formatException(record.exc_info)
            line += "".join(f"\n    | {escape(t)}" for t in trace.splitlines())
        return line


_HANDLERS: list[logging.Handler] = []  # kvxferd's handler once setup_logging ran
ADOPTED = ("nixl", "py.warnings")
"""Loggers routed into kvxferd's stream: NIXL's, and Python's warnings (with the JSON
format, :func:`setup_logging` turns warnings into ``py.warnings`` records)."""


def adopt(name: str) -> None:
    """Route logger ``name`` (a library's, e.g. NIXL's ``nixl``) through kvxferd's handler,
    keeping its level; nothing before :func:`setup_logging` ran. Call it again after the
    library configured its logging (NIXL does so when imported: kvxferd.nixl._binding)."""
    if not _HANDLERS:
        return
    lg = logging.getLogger(name)
    lg.handlers[:] = list(_HANDLERS)
    lg.propagate = False


# glog-style ("E1123 12:00:00.000000 123 file.cc:45] ...") and UCX ("... UCX  ERROR ...").
_NATIVE_LEVELS = (
    (re.compile(r"^F\d{4} "), "fatal"),
    (re.compile(r"^E\d{4} |\bUCX\s+ERROR\b"), "error"),
    (re.compile(r"^W\d{4} |\bUCX\s+WARN"), "warning"),
)


def native_level(line: str) -> tuple[int, str]:
    """The level a native output line is logged at, and the level the line itself names.

    A native error is logged as a WARNING (CRITICAL for a fatal one): NIXL and UCX report
    conditions kvxferd handles (a peer sending its own agent name, a refused connection) as
    errors, and what kvxferd makes of them is its own log line at its own level."""
    for rx, named in _NATIVE_LEVELS:
        if rx.search(line):
            return (logging.CRITICAL if named == "fatal" else logging.WARNING), named
    return logging.INFO, ""


class NativeCapture:
    """Redirect file descriptor ``fd`` into a pipe and log each line written to it.

    A daemon thread reads the pipe and logs lines as ``kvxferd.native`` records (the
    ``stream`` field says which descriptor). :meth:`stop` (also run at exit) puts the
    descriptor back and drains what is left, so a traceback printed at exit is not lost."""

    def __init__(self, fd: int, stream: str) -> None:
        self.fd = fd
        self.stream = stream
        self._saved = os.dup(fd)
        read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)
        self._read = read
        self._log = logging.getLogger("kvxferd.native")
        self._thread = threading.Thread(target=self._run, name=f"kvxferd-{stream}", daemon=True)
        self._thread.start()

    def _emit(self, raw: bytes) -> None:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if line.strip():
            level, named = native_level(line)
            fields = {"stream": self.stream, **({"native_level": named} if named else {})}
            self._log.log(level, line, extra=kv(**fields))

    def _run(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self._read, 65536)
            except OSError:
                break
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                self._emit(raw)
        if pending:
            self._emit(pending)
        os.close(self._read)

    def stop(self, timeout_s: float = 2.0) -> None:
        if self._saved < 0:
            return
        for f in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                f.flush()
        os.dup2(self._saved, self.fd)  # closes the pipe's last write end: the reader drains
        os.close(self._saved)
        self._saved = -1
        self._thread.join(timeout_s)


_captures: list[NativeCapture] = []


def _stop_captures() -> None:
    while _captures:
        _captures.pop().stop()


def capture_native_output() -> IO[str]:
    """Capture file descriptors 1 and 2 (see :class:`NativeCapture`); Python's
    ``sys.stdout``/``sys.stderr`` move to the original streams. Returns the original stderr,
    for kvxferd's own handler. Idempotent."""
    if not _original:
        for f in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                f.flush()
        out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
        err = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
        _original.append(err)
        if faulthandler.is_enabled():
            faulthandler.enable(file=err)  # a crash dump must not go into the pipe
        _captures.append(NativeCapture(1, "stdout"))
        _captures.append(NativeCapture(2, "stderr"))
        sys.stdout, sys.stderr = out, err
        atexit.register(_stop_captures)
    return _original[0]


_original: list[IO[str]] = []  # the stderr kvxferd's handler writes to while capturing


def setup_logging(level: str = "INFO", fmt: str = "json", *, capture: bool | None = None) -> None:
    """kvxferd's logging: one handler on the ``kvxferd`` logger (and the :data:`ADOPTED`
    libraries'). ``capture`` (default: with the JSON format) also turns native output on
    file descriptors 1 and 2 into log records (:func:`capture_native_output`)."""
    if capture is None:
        capture = fmt == "json"
    stream = capture_native_output() if capture else sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    _HANDLERS[:] = [handler]
    root = logging.getLogger("kvxferd")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    if capture:
        logging.captureWarnings(True)  # a library's UserWarning becomes a record, not text
    for name in ADOPTED:
        adopt(name)


def kv(**fields: Any) -> dict[str, Any]:
    """``logger.info("pull done", extra=kv(request_id=..., bytes=...))``."""
    return {"kv": fields}
