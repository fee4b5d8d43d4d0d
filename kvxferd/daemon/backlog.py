"""What a watch stream has yet to send, bounded.

A watch (WatchTransfers, WatchReleases) gets every change as it happens, and its stream sends
them as fast as its caller reads. A caller that stops reading while keeping the stream open
would otherwise make the daemon keep every later change for it, without end. A
:class:`Backlog` holds at most ``limit`` messages; one more ends the watch: the messages are
dropped at once and the next :meth:`Backlog.get` raises ``ResourceExhausted``, which ends the
stream with that status. The caller's fix is to read faster, or to reopen the watch (its first
messages are the current state) and look up what it missed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

from kvxferd.errors import ResourceExhausted

T = TypeVar("T")

WATCH_BACKLOG = 16384
"""Messages a watch stream may have unsent before the daemon ends it (docs/operations.md)."""


class Backlog(Generic[T]):
    """A FIFO of messages for one watcher: :meth:`put` never blocks; past ``limit`` unsent
    messages (None: no limit) the watch is over and :meth:`get` says why."""

    def __init__(self, limit: int | None, what: str, fix: str) -> None:
        self._items: deque[T] = deque()
        self._limit = limit
        self._what = what
        self._fix = fix
        self._waiter: asyncio.Future[None] | None = None
        self.overflowed = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T) -> None:
        if self.overflowed:
            return
        if self._limit is not None and len(self._items) >= self._limit:
            self.overflowed = True
            self._items.clear()  # what it could not send is dropped now, not when it reads
        else:
            self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> T:
        while not self._items:
            if self.overflowed:
                raise ResourceExhausted(
                    f"this {self._what} fell more than {self._limit} messages behind the"
                    " daemon's changes and was ended",
                    fix=self._fix,
                )
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


__all__ = ["WATCH_BACKLOG", "Backlog"]
