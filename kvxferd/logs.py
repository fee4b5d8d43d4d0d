"""Structured logging: one line per event, JSON or text, configured only by the CLI.

Call sites pass fields as ``extra={"kv": {...}}`` (request ID, peer, sizes); the formatter
writes them as keys. Importing kvxferd never configures logging.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any


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
        fields = " ".join(f"{k}={v}" for k, v in kv.items())
        base = (
            f"{self.formatTime(record)} {record.levelname:<7} {record.name}: {record.getMessage()}"
        )
        line = f"{base} {fields}" if fields else base
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
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
