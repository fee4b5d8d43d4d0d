"""The daemon's heap while it serves: what start-up built is frozen out of the collector.

A daemon carries ~180K long-lived objects from its imports (torch, gRPC, NIXL) and start-up (the
pool, the registrations). CPython's full collection walks all of them: tens of milliseconds
during which the event loop runs nothing (docs/operations.md, "Garbage collection"). Once the
daemon is ready, :func:`serving_heap` collects the start-up garbage, then freezes the survivors
(``gc.freeze``): later collections walk only what was made since. On the way out it unfreezes
them, so the interpreter's shutdown sees the heap it would have seen without the freeze.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvxferd.logs import kv

log = logging.getLogger(__name__)


@contextmanager
def serving_heap() -> Iterator[int]:
    """Freeze the objects alive now for the duration of the block; yields how many."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug(
        "heap frozen",
        extra=kv(objects=frozen, ms=round((time.perf_counter() - t0) * 1e3, 1)),
    )
    try:
        yield frozen
    finally:
        gc.unfreeze()


__all__ = ["serving_heap"]
