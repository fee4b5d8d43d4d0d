"""The staging ring: one buffer of ``chunks`` slots, its free slots, back-pressure.

Allocated once at start on the pool's device (DRAM on CPU, VRAM on GPU) and registered with
NIXL once by the wiring. Slots are shared by the owner side (gathers granted to readers) and
the reader side (chunks being read and scattered). Waiting for a slot is awaiting a future
that :meth:`StagingRing.give` resolves, first come first served; nothing polls. Reader chunks
may hold at most half the slots (``reader_cap``), so the owner side always has slots for
peers' gathers and two daemons reading from each other cannot deadlock on each other's rings.
The owner side applies its own per-reader cap and fair order on top
(:class:`kvxferd.staging.owner.StagingOwner`).

Event-loop only (no locks): every method runs on the daemon's loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch

from kvxferd.errors import InvalidRequest
from kvxferd.staging.chunks import RingInfo


def half_cap(chunks: int) -> int:
    """The documented per-party cap of a ring of ``chunks`` slots: half, at least one."""
    return max(1, chunks // 2)


class StagingRing:
    """A contiguous ``uint8`` buffer cut into equal slots, with its free ones and waiters."""

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
            int(buffer.data_ptr()), chunk_bytes, chunks, int(buffer.device.index or 0), stream=True
        )
        self.reader_cap = half_cap(chunks)
        self._free: deque[int] = deque(range(chunks))
        self._waiters: deque[asyncio.Future[int]] = deque()
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
        return len(self._free)

    @property
    def taken_slots(self) -> int:
        return len(self._taken)

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of ``slot`` (a contiguous uint8 tensor)."""
        off = self.info.slot_offset(slot)
        if not 0 <= nbytes <= self.info.chunk_bytes:
            raise InvalidRequest(f"{nbytes} bytes do not fit a {self.info.chunk_bytes}-byte slot")
        return self.buffer[off : off + nbytes]

    def _has_waiters(self) -> bool:
        while self._waiters and self._waiters[0].done():  # cancelled while waiting
            self._waiters.popleft()
        return bool(self._waiters)

    def try_take(self) -> int | None:
        """A free slot now, or None when none is free or someone is already waiting for one
        (waiters keep their turn)."""
        if not self._free or self._has_waiters():
            return None
        slot = self._free.popleft()
        self._taken.add(slot)
        return slot

    def claim(self) -> asyncio.Future[int]:
        """A future resolved with a taken slot, in arrival order among waiters. Cancel it to
        stop waiting; a resolved claim's slot belongs to the caller (``give`` it back)."""
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        slot = self.try_take()
        if slot is not None:
            fut.set_result(slot)
        else:
            self._waiters.append(fut)
        return fut

    async def take(self) -> int:
        """A free slot, awaiting one if none is free (FIFO among waiters)."""
        fut = self.claim()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.give(fut.result())  # handed over just as the caller gave up
            raise

    def give(self, slot: int) -> None:
        """Return a taken slot (to the first waiter, if any); returning a free slot is a bug
        and raises."""
        if slot not in self._taken:
            raise InvalidRequest(f"staging slot {slot} is not taken", field="slot")
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(slot)  # stays taken: it changes hands
                return
        self._taken.discard(slot)
        self._free.append(slot)

    @asynccontextmanager
    async def reader_slots(self, want: int) -> AsyncIterator[list[int]]:
        """Up to ``want`` slots for one reader pull, returned on exit: the first awaited, the
        others only if free now (within ``reader_cap`` and nobody waiting), so pulls never
        wait on each other's partial sets."""
        slots: list[int] = []
        await self._readers.acquire()
        permits = 1
        try:
            slots.append(await self.take())
            while len(slots) < want and not self._readers.locked():
                await self._readers.acquire()  # free now: returns at once
                permits += 1
                slot = self.try_take()
                if slot is None:
                    break
                slots.append(slot)
            yield slots
        finally:
            for slot in slots:
                self.give(slot)
            for _ in range(permits):
                self._readers.release()

    @asynccontextmanager
    async def reader_slot(self) -> AsyncIterator[int]:
        """A slot for one reader chunk (at most ``reader_cap`` at once), returned on exit."""
        async with self._readers:
            slot = await self.take()
            try:
                yield slot
            finally:
                self.give(slot)
