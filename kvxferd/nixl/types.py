"""Typed values at the NIXL boundary: memory kinds, operations, transfer states, telemetry.

NIXL speaks in strings (``"DRAM"``, ``"READ"``, ``"DONE"``/``"PROC"``/``"ERR"``); kvxferd never
does. These enums and dataclasses are what the rest of the daemon sees.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxferd.errors import InvalidRequest

Int64Array = npt.NDArray[np.int64]


class MemType(enum.Enum):
    """Kind of memory a region or descriptor lives in (NIXL's segment type)."""

    DRAM = "DRAM"
    VRAM = "VRAM"


class XferOp(enum.Enum):
    """One-sided operation: READ pulls remote bytes into local memory, WRITE pushes."""

    READ = "READ"
    WRITE = "WRITE"


class XferState(enum.Enum):
    """State of a posted transfer as NIXL reports it when polled."""

    IN_PROGRESS = "PROC"
    DONE = "DONE"
    FAILED = "ERR"

    @classmethod
    def from_nixl(cls, status: str) -> XferState:
        try:
            return cls(status)
        except ValueError:
            return cls.FAILED


class ProgressMode(enum.Enum):
    """How the UCX worker makes progress (see :mod:`kvxferd.nixl` for the measured trade-off).

    ``THREAD``: NIXL's own progress thread, sleeping ``progress_delay_us`` between sweeps
    (the Python wrapper hard-codes 0, a busy spin; kvxferd sets the delay through the raw
    binding). ``POLL``: no progress thread; kvxferd's NIXL thread progresses the worker each
    time it polls notifications or transfers.
    """

    THREAD = "thread"
    POLL = "poll"


@dataclass(frozen=True)
class XferTelemetry:
    """Per-transfer figures from NIXL (``capture_telemetry=True``); times in microseconds."""

    post_us: int
    xfer_us: int
    total_bytes: int
    descriptors: int


def check_descs(descs: Int64Array, what: str) -> Int64Array:
    """Validate an ``N x 3`` ``(addr, len, dev)`` descriptor array; return it C-contiguous int64.

    NIXL reports malformed input by returning ``None`` (and a later ``TypeError``), so the shape,
    dtype and values are checked here, where the message can say which argument is wrong.
    """
    arr = np.asarray(descs)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise InvalidRequest(
            f"descriptor array must be N x 3 (addr, len, dev), got shape {arr.shape}",
            field=what,
            fix="build descriptors with kvxferd.transfer.descriptors",
        )
    if arr.dtype != np.int64:
        if not np.issubdtype(arr.dtype, np.integer):
            raise InvalidRequest(
                f"descriptor array must be integer, got {arr.dtype}",
                field=what,
                fix="use np.int64",
            )
        arr = arr.astype(np.int64)
    if arr.shape[0] and (
        int(arr[:, 1].min()) <= 0 or int(arr[:, 0].min()) <= 0 or int(arr[:, 2].min()) < 0
    ):
        raise InvalidRequest(
            "descriptor addresses and lengths must be positive and devices non-negative",
            field=what,
            fix="drop empty ranges before posting; check region bases",
        )
    return np.ascontiguousarray(arr)
