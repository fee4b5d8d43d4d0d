"""Owner side glue: NIXL notifications -> lease table, periodic reaping, release feed.

:class:`NotificationPump` runs as a poller on the NIXL thread: it drains the agent's
notifications, decodes each (:mod:`kvxferd.transfer.notify`), hands it to the lease table,
which counts it only when it carries the ticket of a reader still reading (the sender's agent
name is logged, never trusted), and reaps expired shares and leases every ``reap_interval_s``.
Undecodable and stray messages are dropped and reported to ``on_result``
(``counted``/``stray``/``undecodable``) for the metrics. WRITE_DONE notifications (push mode:
an owner finished writing into this daemon's blocks) go to ``on_write_done(sender, note)``,
which says whether they completed a push this daemon is waiting for; while ``expecting()`` says
one is due, the pump polls back to back (``busy_poll_s``) instead of at the agent's idle pace.
A reader's READ_DONE is due from its share's grant until the share ends
(:mod:`kvxferd.transfer.due`): meanwhile the pump asks for a short wait between polls within
``read_due_s`` of the last grant and a longer one after it (:meth:`NotificationPump.prompt_reads`),
so the blocks go back to the engine sooner: at the agent's idle pace (5 ms) a READ_DONE waits
2.5 ms on average.
:class:`ReleaseFeed` turns the table's release callbacks into an async iterator for the service
layer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from kvxferd.errors import KvxferdError
from kvxferd.logs import kv
from kvxferd.nixl import NixlAgent
from kvxferd.transfer import notify
from kvxferd.transfer.leases import LeaseTable, Released

log = logging.getLogger(__name__)

SPIN_S = 20e-6
"""The pump's wait between polls when a notification is due and it should come promptly: a
WRITE_DONE while a push is expected, or a READ_DONE within the window after a grant where the
daemon busy polls (:data:`READ_DUE_SPIN_S`)."""
READ_DUE_SPIN_S = SPIN_S
READ_DUE_WAIT_S = 0.5e-3
"""... and where it does not."""
READ_DUE_LONG_S = 1e-3
"""... and after the window while a share still reads (a long READ between hosts): 1,000
wake-ups a second (4 % of a core on the 2-core VM), not the agent's 200."""


class NotificationPump:
    """Counts READ_DONE notifications into ``leases``; starts nothing until :meth:`start`."""

    def __init__(
        self,
        agent: NixlAgent,
        leases: LeaseTable,
        *,
        reap_interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        on_result: Callable[[str], None] | None = None,
    ) -> None:
        self.on_result = on_result
        self.on_write_done: Callable[[str, notify.Notification], bool] | None = None
        self.expecting: Callable[[], bool] | None = None
        self.busy_poll_s = SPIN_S
        self.read_due_s = 0.0  # after a grant, poll at read_due_wait_s this long (0: off)
        self.read_due_wait_s = 0.0  # then at READ_DUE_LONG_S while a share still reads
        self._resting = False  # the last poll asked for more than the short wait
        self._agent = agent
        self._leases = leases
        self._reap_interval_s = reap_interval_s
        self._clock = clock
        self._next_reap = 0.0
        self.dropped = 0

    def start(self) -> None:
        self._agent.add_poller(self.poll)

    def prompt_reads(self, window_s: float, *, spin: bool) -> None:
        """While a granted share still reads: for ``window_s`` after the last grant poll every
        :data:`READ_DUE_SPIN_S` (``spin``: the daemon busy polls, kvxferd/busypoll.py) or
        :data:`READ_DUE_WAIT_S`, then every :data:`READ_DUE_LONG_S`; ``window_s = 0`` turns it
        off (the agent's idle pace)."""
        if not window_s >= 0:
            raise ValueError(f"the read-due window must be >= 0 s, got {window_s}")
        self.read_due_s = window_s
        self.read_due_wait_s = READ_DUE_SPIN_S if spin else READ_DUE_WAIT_S
        self._leases.due.on_grant = self._granted if window_s else None

    def _granted(self) -> None:
        """A share was granted: a resting NIXL thread polls at once, from the service loop's
        next turn (after the confirmation's answer is written) where this runs on it."""
        if self._resting:
            self._resting = False
            try:
                asyncio.get_running_loop().call_soon(self._agent.wake)
            except RuntimeError:  # no loop on this thread
                self._agent.wake()

    def stop(self) -> None:
        self._agent.remove_poller(self.poll)

    def poll(self) -> float | None:
        """One sweep (runs on the NIXL thread); returns how long it may wait."""
        try:
            notifs = self._agent.get_notifs()
        except KvxferdError as err:
            log.warning("notification poll failed", extra=kv(error=str(err)))
            notifs = {}
        for sender, msgs in notifs.items():
            for msg in msgs:
                try:
                    note = notify.decode(msg)
                except KvxferdError as err:
                    self.dropped += 1
                    self._report("undecodable")
                    log.warning(
                        "notification dropped",
                        extra=kv(sender=sender, bytes=len(msg), error=str(err)),
                    )
                    continue
                if note.kind is notify.NotifKind.WRITE_DONE:
                    hook = self.on_write_done
                    if hook is not None and hook(sender, note):
                        self._report("counted")
                    else:
                        self.dropped += 1
                        self._report("stray")
                        log.warning(
                            "stray WRITE_DONE notification ignored",
                            extra=kv(sender=sender, request_id=note.request_id),
                        )
                elif note.kind is notify.NotifKind.READ_DONE:
                    if self._leases.notified(note.request_id, note.ticket):
                        self._report("counted")
                    else:
                        self.dropped += 1
                        self._report("stray")
                        log.warning(
                            "stray notification ignored",
                            extra=kv(sender=sender, request_id=note.request_id),
                        )
        now = self._clock()
        if now >= self._next_reap:
            self._leases.reap()
            self._next_reap = now + self._reap_interval_s
        if self.expecting is not None and self.expecting():
            return self.busy_poll_s  # a WRITE_DONE is due: do not sleep the idle wait
        # Resting from before the check: a grant after it wakes the thread (_granted).
        self._resting = True
        if self.read_due_s:
            wait = self._leases.due.wait(self.read_due_s, self.read_due_wait_s, READ_DUE_LONG_S)
            if wait is not None:  # a granted share still reads: its READ_DONE is due
                self._resting = wait > self.read_due_wait_s  # past the window: a grant wakes it
                return wait
        return None

    def _report(self, result: str) -> None:
        if self.on_result is not None:
            self.on_result(result)


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
