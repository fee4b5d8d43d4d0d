"""Owner side glue: NIXL notifications -> lease table, periodic reaping, release feed.

:class:`NotificationPump` runs as a poller on the NIXL thread: it drains the agent's
notifications, decodes each (:mod:`kvxferd.transfer.notify`), counts it against the lease table
by sender agent name, and reaps expired leases every ``reap_interval_s``. Undecodable messages
are logged and dropped. :class:`ReleaseFeed` turns the table's release callbacks into an async
iterator for the service layer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from kvxferd.errors import KvxferdError
from kvxferd.nixl import NixlAgent
from kvxferd.transfer import notify
from kvxferd.transfer.leases import LeaseTable, Released

log = logging.getLogger(__name__)


class NotificationPump:
    """Counts READ_DONE notifications into ``leases``; starts nothing until :meth:`start`."""

    def __init__(
        self,
        agent: NixlAgent,
        leases: LeaseTable,
        *,
        reap_interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._agent = agent
        self._leases = leases
        self._reap_interval_s = reap_interval_s
        self._clock = clock
        self._next_reap = 0.0
        self.dropped = 0

    def start(self) -> None:
        self._agent.add_poller(self.poll)

    def stop(self) -> None:
        self._agent.remove_poller(self.poll)

    def poll(self) -> float | None:
        """One sweep (runs on the NIXL thread); returns how long it may wait."""
        try:
            notifs = self._agent.get_notifs()
        except KvxferdError as err:
            log.warning("event=notif_poll_failed error=%s", err)
            notifs = {}
        for sender, msgs in notifs.items():
            for msg in msgs:
                try:
                    note = notify.decode(msg)
                except KvxferdError as err:
                    self.dropped += 1
                    log.warning(
                        "event=notif_dropped sender=%s bytes=%d error=%s", sender, len(msg), err
                    )
                    continue
                if note.kind is notify.NotifKind.READ_DONE:
                    self._leases.complete(note.request_id, sender)
        now = self._clock()
        if now >= self._next_reap:
            self._leases.reap()
            self._next_reap = now + self._reap_interval_s
        return None


class ReleaseFeed:
    """Async iterator of :class:`Released` leases; subscribe it with ``table.subscribe(feed)``.

    Thread-safe: releases may happen on the NIXL thread or the service loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Released] = asyncio.Queue()

    def __call__(self, released: Released) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, released)

    def __aiter__(self) -> AsyncIterator[Released]:
        return self

    async def __anext__(self) -> Released:
        return await self._queue.get()
