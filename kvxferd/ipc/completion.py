"""Waiting for a copy's completion event on the event loop, and never leaving before it ends.

:func:`wait_event` polls an event (a CUDA event, or anything with ``query()`` and
``synchronize()``) between turns of the loop: a small KERNEL pull's copy takes tens of
microseconds, far less than a hop to a worker thread and back. Each poll is one
``asyncio.sleep(0)``, not a timed sleep, because the loops cannot sleep for less than a
millisecond: uvloop rounds a delay to whole milliseconds (under 0.5 ms it runs at the next
turn, as ``sleep(0)`` does) and the stdlib loop's epoll waits at least 1 ms for any positive
timeout when nothing else is ready. A "100 us" sleep would therefore be a yield on one loop and
a 1 ms stall on the other. Polls stop after :data:`POLL_LIMIT_S`; a copy still running then is
waited on in a worker thread (``synchronize()``), so a slow copy costs at most that much loop
time.

Both waits are uninterruptible (:func:`settle`): a cancellation that arrives meanwhile is
raised once the event has fired, so a caller that holds the copy's memory (the mappings of
:meth:`kvxferd.ipc.mapping.PeerMaps.use`) never releases it under a running copy.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol, TypeVar

T = TypeVar("T")

# How long a copy's event is polled on the loop before the wait moves to a worker thread. An
# inline pull's copy (kvxferd.ipc.reader.INLINE_MAX_BYTES) ends well within it on an idle GPU;
# past it the copy is slow (the GPU is busy) and the thread hop (~0.2 ms) is a small part of
# the wait, while polling on would only spin the loop.
POLL_LIMIT_S = 1e-3


class Completion(Protocol):
    """What :func:`wait_event` needs of an event (``torch.cuda.Event`` has both)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class Waited:
    """How :func:`wait_event` saw the event fire: ``polls`` turns of the loop yielded, and
    whether the wait ended in a worker thread (the polls ran out)."""

    polls: int
    thread: bool


async def settle(fut: asyncio.Future[T]) -> T:
    """The result of ``fut``, awaited to its end even if the calling task is cancelled meanwhile
    (the cancellation is raised once ``fut`` is done; ``fut`` itself is never cancelled)."""
    cancelled: asyncio.CancelledError | None = None
    while not fut.done():
        try:
            await asyncio.wait((fut,))  # never cancels fut nor raises its exception
        except asyncio.CancelledError as exc:
            cancelled = exc  # this task was cancelled, not fut: wait on
    if cancelled is not None:
        if not fut.cancelled():
            fut.exception()  # retrieved: the cancellation wins
        raise cancelled
    return fut.result()


async def wait_event(event: Completion, *, limit_s: float = POLL_LIMIT_S) -> Waited:
    """Return once ``event`` has fired: ``query()`` polled with a yield to the loop between
    polls for up to ``limit_s``, then ``synchronize()`` in a worker thread. A cancellation of
    the calling task is held until then and raised after (see :func:`settle`)."""
    cancelled: asyncio.CancelledError | None = None
    polls = 0
    end = time.monotonic() + limit_s
    thread = False
    while not event.query():
        if time.monotonic() >= end:
            thread = True
            fut = asyncio.get_running_loop().run_in_executor(None, event.synchronize)
            try:
                await settle(fut)
            except asyncio.CancelledError as exc:  # raised by settle once the event fired
                cancelled = exc
            break
        polls += 1
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError as exc:
            cancelled = exc  # the copy still runs: poll on, raise when it has ended
    if cancelled is not None:
        raise cancelled
    return Waited(polls, thread)
