"""Structured logging: one line per event, JSON or text, configured only by the CLI.

Call sites pass fields as ``extra={"kv": {...}}`` (request ID, peer, sizes); the formatter
writes them as keys. Importing kvxferd never configures logging.

Values often come from callers (request and transfer IDs, peer addresses), so neither format
lets them forge lines or fields: JSON escapes everything; text escapes control and line-break
characters (``\n`` as ``\\n``, NUL as ``\\x00``, ...) in the message and every value, and
quotes a value holding a space, ``=`` or ``"``. Traceback lines are indented.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

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


def setup_logging(level: str = "INFO", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger("kvxferd")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def kv(**fields: Any) -> dict[str, Any]:
    """``logger.info("pull done", extra=kv(request_id=..., bytes=...))``."""
    return {"kv": fields}
