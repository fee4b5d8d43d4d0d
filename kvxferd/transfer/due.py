"""Which READ_DONE notifications are due soon: the owner's lease table tells the notification
pump (kvxferd/transfer/owner.py) when it granted a share, whose reader will READ and notify
within milliseconds, so that the pump polls promptly until the notification came instead of at
the NIXL agent's idle pace (5 ms: 2.5 ms more on average before the blocks go back).

It also hands each READ_DONE's time since its grant to a hook (the owner's
``kvxferd_lease_read_seconds``: how long one read holds the blocks, notification included).

Pure and clock-injected, like the lease table that feeds it (under its lock) from the service
loop, while the pump asks from the NIXL thread: its own lock keeps the two consistent.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable


class ReadDue:
    """Shares granted and not yet notified, and when the last one was granted."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.granted_at = -math.inf  # the clock's time of the last grant
        self._count = 0
        self.on_grant: Callable[[], None] | None = None  # after each grant: must not block
        # Each READ_DONE counted, with the seconds since its share's grant (a metric's observe).
        self.on_read_done: Callable[[float], None] | None = None

    def granted(self, now: float, *, new: bool) -> None:
        """A reader confirmed: a share was granted (``new``) or renewed, and it is about to
        READ; the hook runs (it wakes a resting pump)."""
        with self._lock:
            self.granted_at = now
            self._count += new
        if self.on_grant is not None:
            self.on_grant()

    def notified(self, since_grant_s: float) -> None:
        """A granted share's READ_DONE was counted, ``since_grant_s`` after its grant."""
        with self._lock:
            self._count = max(0, self._count - 1)
        if self.on_read_done is not None:
            self.on_read_done(since_grant_s)

    def due(self, within_s: float) -> bool:
        """Whether a READ_DONE is due: a share was granted less than ``within_s`` ago and not
        every share granted meanwhile has been notified. A share that ends some other way
        (FinishPull, a decline, its lapse) keeps the answer True only until ``within_s`` after
        the last grant, when the count starts again from zero."""
        with self._lock:
            if self._clock() - self.granted_at >= within_s:
                self._count = 0
                return False
            return self._count > 0


__all__ = ["ReadDue"]
