"""Gathers waiting for a staging slot, served fairly between readers.

One FIFO queue per reader; freed slots go round-robin over the readers that wait and are
under their cap (a reader at its cap is skipped until one of its own slots comes back), so a
reader that asks for many slots gets one per turn, like every other waiting reader.
Event-loop only.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvxferd.errors import ResourceExhausted
from kvxferd.staging.stats import Occupancy

# A Gather that cannot get a slot gives up this much before its caller's deadline (a tenth of
# the time, at most this), so the caller reads why (ResourceExhausted and its fix), not a bare
# DEADLINE_EXCEEDED.
REPLY_MARGIN_S = 0.2


@dataclass(eq=False)
class Waiter:
    """One Gather waiting for a slot; ``fut`` resolves with a slot already granted to it."""

    request_id: str
    reader: str
    fut: asyncio.Future[int]


class FairQueue:
    """Waiting Gathers by reader. ``held(reader)``: slots that reader holds now; a reader
    with ``cap`` or more is not served."""

    def __init__(self, cap: int, held: Callable[[str], int]) -> None:
        self.cap = cap
        self._held = held
        self._queues: dict[str, deque[Waiter]] = {}  # reader -> its waiting Gathers, FIFO
        self._turn: deque[str] = deque()  # readers with waiting Gathers, round-robin order

    def push(self, w: Waiter) -> None:
        q = self._queues.get(w.reader)
        if q is None:
            q = self._queues[w.reader] = deque()
            self._turn.append(w.reader)
        q.append(w)

    def eligible(self) -> str | None:
        """The first reader in turn that waits and is under its cap."""
        for reader in self._turn:
            if self._held(reader) < self.cap:
                return reader
        return None

    def pop_next(self) -> Waiter | None:
        """Pop the waiter served next (round-robin over eligible readers, FIFO within one);
        its reader moves to the back of the turn."""
        for reader in list(self._turn):
            if self._held(reader) >= self.cap:
                continue
            q = self._queues[reader]
            while q and q[0].fut.done():  # cancelled; its coroutine unqueues it soon
                q.popleft()
            self._turn.remove(reader)
            if not q:
                del self._queues[reader]
                continue
            w = q.popleft()
            if q:
                self._turn.append(reader)
            else:
                del self._queues[reader]
            return w
        return None

    def remove(self, w: Waiter) -> None:
        q = self._queues.get(w.reader)
        if q is not None and w in q:
            q.remove(w)
            if not q:
                del self._queues[w.reader]
                self._turn.remove(w.reader)

    def of(self, reader: str) -> list[Waiter]:
        """``reader``'s waiting Gathers, oldest first (a copy)."""
        return list(self._queues.get(reader, ()))

    def all(self) -> list[Waiter]:
        """Every waiting Gather (a copy)."""
        return [w for q in self._queues.values() for w in q]

    def counts(self) -> dict[str, int]:
        """Waiting Gathers per reader, for readers that have any."""
        return {r: len(q) for r, q in self._queues.items() if q}


def waited_in_vain(
    reader: str, held: int, cap: int, timeout_s: float, occ: Occupancy
) -> ResourceExhausted:
    """Why ``reader``'s Gather got no slot within ``timeout_s``: its cap, or a full ring."""
    chunks = occ.slots
    if held >= cap:
        return ResourceExhausted(
            f"reader {reader!r} holds {held} staging slot(s) here, its cap ({cap}"
            f" of the ring's {chunks}: one reader may hold at most half), and none of them"
            f" was released within {timeout_s:.3f}s; a reader at its cap waits for its own"
            " slots and never takes other readers'",
            fix="release each slot as soon as it is read (ReleaseStaging, or the next"
            " Gather's release_slots) before gathering more, or read with fewer chunks in"
            " flight; for more per reader raise transfer.staging_chunks on the owner",
        )
    return ResourceExhausted(
        f"no staging slot became free within {timeout_s:.3f}s: all {chunks} are in use"
        f" ({occ.granted_total} granted to {len(occ.granted)} reader(s), {occ.local} used by"
        f" this daemon's own pulls; {occ.waiting_total} Gather(s) waiting; reader"
        f" {reader!r} holds {held} of its cap {cap})",
        fix="retry later or with a longer deadline, or raise transfer.staging_chunks on the owner",
    )


__all__ = ["FairQueue", "Waiter", "waited_in_vain"]
