"""Small gathers on the event loop: a Stage stream's chunk without a hop into a worker thread.

A chunk of at most :data:`~kvxferd.staging.device.INLINE_GATHER_BYTES` whose reader can take a
slot at once (:meth:`StagingOwner.try_grant`: a free slot, under its cap, nobody else's turn)
is gathered where the credit allowing it arrived: on CPU the twin copies it there and then; on
CUDA the gather kernel is launched on the copier's side stream and its event is polled between
loop turns (:func:`kvxferd.ipc.completion.wait_event`, as KERNEL's small pulls do). Anything
else (a larger chunk, a slot to wait for) goes through :meth:`StagingOwner.fill` and its worker
thread. Either way the slot is answered through :meth:`StagingOwner.answer` (the same checks:
taken back meanwhile, lease ended) and is freed only once nothing writes it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvxferd.ipc.completion import wait_event
from kvxferd.staging.device import INLINE_GATHER_BYTES, Int64Array
from kvxferd.staging.grant import Grant
from kvxferd.staging.owner import StagingOwner


@dataclass(frozen=True)
class Launched:
    """A gather started on the loop into granted ``slot``: done, or running until ``event``."""

    request_id: str
    slot: int
    nbytes: int
    started_at: float  # monotonic, as the gather started
    t0: float  # perf_counter, as the gather started
    copy_s: float  # the copy (CPU) or its launch (CUDA)
    event: torch.cuda.Event | None


def launch(
    owner: StagingOwner, request_id: str, reader: str, ids: Sequence[Int64Array], total: int
) -> Launched | None:
    """Gather checked ``ids`` (``total`` bytes) into a slot granted now, on the loop; None (and
    nothing taken) when the chunk is too large or ``reader`` would have to wait for a slot."""
    if total > INLINE_GATHER_BYTES:
        return None
    slot = owner.try_grant(request_id, reader)
    if slot is None:
        return None
    started_at, t0 = time.monotonic(), time.perf_counter()
    try:
        event = owner.copier.launch_gather(ids, owner.ring.view(slot, total))
    except BaseException:
        owner.abandon(slot)  # nothing was launched: the slot is not written
        raise
    return Launched(request_id, slot, total, started_at, t0, time.perf_counter() - t0, event)


async def land(owner: StagingOwner, got: Launched) -> Grant:
    """The grant of ``got`` once its bytes are in the slot (raises as :meth:`StagingOwner.answer`
    does). A cancellation waits for a running gather, frees the slot and is raised."""
    seconds = got.copy_s
    if got.event is not None:
        try:
            await wait_event(got.event)  # a cancellation is raised only once the event fired
        except BaseException:
            owner.abandon(got.slot)
            raise
        seconds = time.perf_counter() - got.t0
    return owner.answer(
        got.request_id, got.slot, got.nbytes, seconds=seconds, waited=0.0, at=got.started_at
    )


async def discard(owner: StagingOwner, got: Launched) -> None:
    """Free ``got``'s slot unannounced (the stream stopped), once its gather has ended."""
    try:
        if got.event is not None:
            await wait_event(got.event)
    finally:
        owner.abandon(got.slot)


__all__ = ["Launched", "discard", "land", "launch"]
