"""Progress line, percentiles and plain-text tables (no dependency beyond the standard library)."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def json_safe(obj: Any) -> Any:
    """``obj`` with NaN and infinities replaced by None (JSON has neither)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def fmt(value: float, digits: int = 2) -> str:
    """A number for a table cell; ``-`` for NaN or infinity."""
    if not math.isfinite(value):
        return "-"
    return f"{value:,.{digits}f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1) -> str:
    """A plain-text table; the first ``left`` columns align left, the others right."""
    widths = [len(h) for h in headers]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells, the table {len(headers)} columns")
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


class Progress:
    """A progress bar on a terminal (``\\r``-updated), one line per step otherwise, or nothing.

    ``mode``: ``"bar"``, ``"lines"`` or ``"off"``; :meth:`auto` picks bar on a TTY, lines
    elsewhere, off when quiet.
    """

    WIDTH = 28

    def __init__(self, total: int, *, mode: str, stream: TextIO | None = None) -> None:
        if mode not in ("bar", "lines", "off"):
            raise ValueError(f"unknown progress mode {mode!r}")
        self.total = max(0, total)
        self.mode = mode
        self.stream = stream if stream is not None else sys.stderr
        self._started = time.monotonic()
        self._last_len = 0

    @classmethod
    def auto(cls, total: int, *, quiet: bool, stream: TextIO | None = None) -> Progress:
        out = stream if stream is not None else sys.stderr
        if quiet:
            return cls(total, mode="off", stream=out)
        isatty = getattr(out, "isatty", None)
        return cls(total, mode="bar" if isatty is not None and isatty() else "lines", stream=out)

    def bar(self, done: int, text: str = "") -> str:
        """The bar line for ``done`` of ``total`` steps (without ``\\r``)."""
        frac = 1.0 if self.total == 0 else min(1.0, done / self.total)
        filled = round(frac * self.WIDTH)
        elapsed = time.monotonic() - self._started
        return (
            f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{self.total}"
            f" {elapsed:5.1f}s {text}"
        ).rstrip()

    def update(self, done: int, text: str = "", *, line: str = "") -> None:
        """Show ``done`` steps; ``line`` is what lines mode prints for this step."""
        if self.mode == "bar":
            s = self.bar(done, text)
            pad = " " * max(0, self._last_len - len(s))
            self.stream.write(f"\r{s}{pad}")
            self._last_len = len(s)
            self.stream.flush()
        elif self.mode == "lines":
            self.stream.write(f"{line or self.bar(done, text)}\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        """Print a line without breaking the bar (it is redrawn by the next update)."""
        if self.mode == "off":
            return
        if self.mode == "bar" and self._last_len:
            self.stream.write("\r" + " " * self._last_len + "\r")
            self._last_len = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.mode == "bar" and self._last_len:
            self.stream.write("\n")
            self.stream.flush()
            self._last_len = 0
