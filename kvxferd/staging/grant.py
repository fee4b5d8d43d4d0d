"""A granted staging slot: the answer a reader gets (:class:`Grant`) and the owner's record of
the slot while the reader holds it (:class:`Held`). See :mod:`kvxferd.staging.owner`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(frozen=True)
class Grant:
    """A gathered chunk: where it lies in the ring and how long the gather took."""

    slot: int
    offset: int
    nbytes: int
    gather_s: float
    wait_s: float = 0.0  # waiting for a slot (other readers', or this reader at its cap)
    started_at: float = 0.0  # monotonic: when the gather thread started copying


@dataclass
class Held:
    """A granted slot as the owner holds it, from the grant to its return."""

    request_id: str
    reader: str
    timer: asyncio.TimerHandle | None = None  # the grant timeout, from the answer on
    busy: bool = True  # its gather (thread or CUDA event) still writes it, or is about to
    revoked: str = ""  # taken back while busy (why): free it when the gather ends


__all__ = ["Grant", "Held"]
