"""Tasks that start now: one loop turn less per hop on the control path (Python >= 3.12).

A task made with ``create_task`` first runs on the loop's next turn, after every callback
already queued; on the path of a pull (a frame read, its handler, the lease confirmation sent)
each such turn is a hop of tens of microseconds. :func:`start_now` makes the task *eager*
(``asyncio.eager_task_factory``, Python 3.12): its coroutine runs at once, in the caller's
step, up to its first real suspension, and is scheduled as usual from there; one that finishes
without suspending never touches the loop. On Python 3.11 it is ``create_task``.

The caller must be ready for the coroutine to have run (and possibly finished) when this
returns: a handler that answers synchronously has already written its answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_EAGER: Any = getattr(asyncio, "eager_task_factory", None)

EAGER = _EAGER is not None
"""Whether :func:`start_now` starts tasks eagerly on this Python."""


def start_now(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task for ``coro`` on the running loop, its first step run now where Python allows."""
    loop = asyncio.get_running_loop()
    if _EAGER is not None:
        task: asyncio.Task[T] = _EAGER(loop, coro)
        return task
    return loop.create_task(coro)


__all__ = ["EAGER", "start_now"]
