"""Which READ_DONE notifications are due: the owner's lease table tells the notification pump
(kvxferd/transfer/owner.py) of every share it grants, whose reader will READ and then notify,
so that the pump polls promptly while one of them is still reading instead of at the NIXL
agent's idle pace (5 ms: 2.5 ms more on average before the blocks go back).

A share is due from its grant until it leaves READING, whichever way: its READ_DONE, FinishPull,
a decline, its lapse (the table's reaping lapses a share past its expiry), its engine's detach.
The pump asks :meth:`ReadDue.wait` how long to wait: the short wait within a window after the
last grant (a same-host copy ends within milliseconds), a slower one after it while a share
still reads (a long READ between hosts), none when nothing is due.

It also hands each READ_DONE's time since its grant to a hook (the owner's
``kvxferd_lease_read_seconds``: how long one read holds the blocks, notification included).

Clock-injected, like the lease table that feeds it (under its own lock) from the service loop,
while the pump asks from the NIXL thread: this class's lock keeps the list consistent; a share's
state is read without the table's lock (one attribute: at worst one poll more or less).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

from kvxferd.transfer.lease import Share, ShareState

PRUNE_AT = 64
"""Shares kept before a grant drops the ended ones: :meth:`ReadDue.wait` drops them too, but a
table whose pump does not ask (``prompt_reads`` off) must not keep every share it granted."""


class ReadDue:
    """The shares granted and not yet seen to end, and when the last one was granted."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.granted_at = -math.inf  # the clock's time of the last grant
        self._shares: list[Share] = []
        self._prune_at = PRUNE_AT  # the list is pruned on a grant once this long
        self.on_grant: Callable[[], None] | None = None  # after each grant: must not block
        # Each READ_DONE counted, with the seconds since its share's grant (a metric's observe).
        self.on_read_done: Callable[[float], None] | None = None

    def granted(self, share: Share, now: float, *, new: bool) -> None:
        """A reader confirmed: ``share`` was granted (``new``) or renewed, and it is about to
        READ; the hook runs (it wakes a resting pump)."""
        with self._lock:
            self.granted_at = now
            if new:
                if len(self._shares) >= self._prune_at:  # bounded when nothing asks (no pump)
                    self._prune_at = max(PRUNE_AT, 2 * len(self._prune()))
                self._shares.append(share)
        if self.on_grant is not None:
            self.on_grant()

    def notified(self, since_grant_s: float) -> None:
        """A granted share's READ_DONE was counted, ``since_grant_s`` after its grant."""
        if self.on_read_done is not None:
            self.on_read_done(since_grant_s)

    def wait(self, window_s: float, short_s: float, long_s: float) -> float | None:
        """How long the pump may wait before its next poll: ``short_s`` while a share is still
        reading and one was granted less than ``window_s`` ago, ``long_s`` while one is still
        reading after that, None when none is (the agent's idle wait)."""
        with self._lock:
            if not self._prune():
                return None
            return short_s if self._clock() - self.granted_at < window_s else long_s

    def _prune(self) -> list[Share]:
        """Drop the shares that left READING (lock held); the ones still reading."""
        if any(s.state is not ShareState.READING for s in self._shares):
            self._shares = [s for s in self._shares if s.state is ShareState.READING]
        return self._shares

    def __len__(self) -> int:
        """Shares granted and not yet seen to end (as of the last :meth:`wait`)."""
        return len(self._shares)


__all__ = ["PRUNE_AT", "ReadDue"]
