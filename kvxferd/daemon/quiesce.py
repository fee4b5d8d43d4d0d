"""Stopping a reader's pulls: at shutdown, and when this daemon's pool goes away.

A pull writes into this daemon's pool until it ends: a NIXL READ until the engine saw it
complete or cancelled it, a KERNEL copy until its event fired, CMA until its workers' calls
returned, STAGED until its scatters ended (each strategy's pull returns only then; a pull's
terminal status is published after it returns). So the pool's memory may be dropped once every
pull into it has ended, and not before: :func:`release_pool` cancels them all and waits for
that. An engine's Detach calls it after emptying the slot, so no new pull can start (planning
needs the pool), and before it swaps the transfer engine's local regions and drops the memory.
"""

from __future__ import annotations

import asyncio
import logging

from kvxferd.daemon.reader import Reader
from kvxferd.logs import kv

log = logging.getLogger(__name__)


async def drain(reader: Reader, timeout_s: float) -> int:
    """Stop taking pulls and wait up to ``timeout_s`` for in-flight ones; cancel the rest.

    Returns how many pulls had to be cancelled."""
    reader.draining = True
    active = reader.pulls.active()
    if not active:
        return 0
    log.info("draining", extra=kv(inflight=len(active), timeout_s=timeout_s))
    waits = [asyncio.ensure_future(reader.pulls.wait_terminal(r.transfer_id)) for r in active]
    _, pending = await asyncio.wait(waits, timeout=timeout_s)
    for r in reader.pulls.active():
        await reader.cancel(r.transfer_id)
    for w in pending:
        w.cancel()
    return len(pending)


async def release_pool(reader: Reader, why: str) -> int:
    """Cancel every pull into this daemon's pool, because ``why``, and return once each has
    ended (none writes into the pool any more). Returns how many were cancelled."""
    active = reader.pulls.active()
    if not active:
        return 0
    reason = f"was cancelled: this daemon's pool went away ({why})"
    await asyncio.gather(*(reader.cancel(r.transfer_id, reason) for r in active))
    log.warning("pulls into the pool cancelled", extra=kv(pulls=len(active), why=why))
    return len(active)


__all__ = ["drain", "release_pool"]
