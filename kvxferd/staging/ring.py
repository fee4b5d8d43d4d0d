"""The staging ring: one buffer of ``chunks`` slots, its free slots, back-pressure.

Allocated once at start on the pool's device (DRAM on CPU, VRAM on GPU) and registered with
NIXL once by the wiring. Slots are shared by the owner side (gathers granted to readers) and
the reader side (chunks being read and scattered). Waiting for a slot is awaiting an
:class:`asyncio.Queue`; nothing polls. Reader chunks may hold at most half the slots
(``reader_cap``), so the owner side always has slots for peers' gathers and two daemons
reading from each other cannot deadlock on each other's rings.

Event-loop only (no locks): every method runs on the daemon's loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch

from kvxferd.errors import InvalidRequest
from kvxferd.staging.chunks import RingInfo


class StagingRing:
    """A contiguous ``uint8`` buffer cut into equal slots, with a queue of free ones."""

    def __init__(self, buffer: torch.Tensor, chunk_bytes: int, chunks: int) -> None:
        if chunks < 2 or chunk_bytes <= 0:
            raise InvalidRequest(
                f"a staging ring needs >= 2 slots of > 0 bytes, got {chunks} x {chunk_bytes}",
                field="transfer.staging_chunks",
                fix="set transfer.staging_chunks >= 2 (or 0 to disable staging)",
            )
        if buffer.dtype != torch.uint8 or buffer.numel() != chunk_bytes * chunks:
            raise InvalidRequest(f"staging buffer must be {chunk_bytes * chunks} uint8 bytes")
        self.buffer = buffer
        self.info = RingInfo(
            int(buffer.data_ptr()), chunk_bytes, chunks, int(buffer.device.index or 0)
        )
        self.reader_cap = max(1, chunks // 2)
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for i in range(chunks):
            self._free.put_nowait(i)
        self._taken: set[int] = set()
        self._readers = asyncio.Semaphore(self.reader_cap)

    @classmethod
    def allocate(cls, chunk_bytes: int, chunks: int, device: str) -> StagingRing:
        return cls(
            torch.empty(chunk_bytes * chunks, dtype=torch.uint8, device=device), chunk_bytes, chunks
        )

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def free_slots(self) -> int:
        return self._free.qsize()

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of ``slot`` (a contiguous uint8 tensor)."""
        off = self.info.slot_offset(slot)
        if not 0 <= nbytes <= self.info.chunk_bytes:
            raise InvalidRequest(f"{nbytes} bytes do not fit a {self.info.chunk_bytes}-byte slot")
        return self.buffer[off : off + nbytes]

    async def take(self) -> int:
        """A free slot, awaiting one if none is free (FIFO among waiters)."""
        slot = await self._free.get()
        self._taken.add(slot)
        return slot

    def give(self, slot: int) -> None:
        """Return a taken slot; returning a free slot is a bug and raises."""
        if slot not in self._taken:
            raise InvalidRequest(f"staging slot {slot} is not taken", field="slot")
        self._taken.discard(slot)
        self._free.put_nowait(slot)

    @asynccontextmanager
    async def reader_slot(self) -> AsyncIterator[int]:
        """A slot for one reader chunk (at most ``reader_cap`` at once), returned on exit."""
        async with self._readers:
            slot = await self.take()
            try:
                yield slot
            finally:
                self.give(slot)
