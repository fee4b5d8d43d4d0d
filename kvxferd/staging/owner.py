"""Owner side of STAGED pulls: gather leased blocks into granted slots; take slots back.

A reader's ``Gather`` names a held request and kernel block IDs per group. Every ID is checked
against the pool's kernel block counts and must be held under that request's lease: nothing
outside the pool, and nothing not leased, is ever copied. The gather runs in a worker thread
(on CUDA, on a side stream with an event wait), and the slot is answered only once the bytes
are there. A granted slot returns to the ring when the reader releases it, when the request's
lease ends (released or expired: the reader is done or gone), or after the grant timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvxferd.blocks import check_block_ids
from kvxferd.errors import InvalidRequest, LeaseRefused, ResourceExhausted
from kvxferd.logs import kv
from kvxferd.pool import KVPool
from kvxferd.staging.chunks import span_offsets
from kvxferd.staging.device import Int64Array, PoolCopier
from kvxferd.staging.ring import StagingRing
from kvxferd.transfer.leases import LeaseTable, Released

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Grant:
    """A gathered chunk: where it lies in the ring and how long the gather took."""

    slot: int
    offset: int
    nbytes: int
    gather_s: float


@dataclass
class _Held:
    request_id: str
    reader: str
    timer: asyncio.TimerHandle
    busy: bool = True  # the gather thread is still writing the slot
    revoked: bool = False  # taken back while busy: free it when the gather ends


class StagingOwner:
    """Grants slots of ``ring`` to readers of requests held in ``leases``."""

    def __init__(
        self,
        ring: StagingRing,
        pool: KVPool,
        leases: LeaseTable,
        *,
        grant_timeout_s: float,
        max_block_ids: int,
    ) -> None:
        self.ring = ring
        self.pool = pool
        self.leases = leases
        self.grant_timeout_s = grant_timeout_s
        self.max_block_ids = max_block_ids
        self.copier = PoolCopier(pool)
        self._grants: dict[int, _Held] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ended: Callable[[Released], None] | None = None

    def start(self) -> None:
        """Reclaim slots when leases end (callbacks arrive on any thread)."""
        loop = asyncio.get_running_loop()
        self._loop = loop

        def ended(rel: Released) -> None:
            loop.call_soon_threadsafe(self._lease_ended, rel.request_id)

        self._ended = ended
        self.leases.subscribe(ended)

    def stop(self) -> None:
        """Stop following lease ends (the pool went away); grants still out come back to the
        ring through their timeout or release, since the ring outlives this owner."""
        if self._ended is not None:
            self.leases.unsubscribe(self._ended)
            self._ended = None

    @property
    def granted(self) -> int:
        return len(self._grants)

    def _check(self, request_id: str, kernel_ids: Sequence[Sequence[int]]) -> list[Int64Array]:
        spec = self.pool.spec
        lease = self.leases.get(request_id)
        if lease is None:
            raise LeaseRefused(
                f"request {request_id!r} is not held here (never held, released or expired)",
                field="request_id",
                fix="gather only requests confirmed with ConfirmLease, before their lease ends",
            )
        if len(kernel_ids) != len(spec.groups):
            raise InvalidRequest(
                f"{len(kernel_ids)} block-ID lists for {len(spec.groups)} KV cache groups",
                field="kernel_block_ids.groups",
                fix="send one list per group (empty for none), in the spec's group order",
            )
        out: list[Int64Array] = []
        for g, ids in enumerate(kernel_ids):
            where = f"kernel_block_ids.groups[{g}]"
            arr = check_block_ids(ids, spec.num_kernel_blocks(g), where, max_ids=self.max_block_ids)
            held = lease.kernel_blocks[g] if g < len(lease.kernel_blocks) else arr[:0]
            outside = arr[~np.isin(arr, held)]
            if outside.size:
                raise LeaseRefused(
                    f"kernel block IDs {outside[:8].tolist()} of group {g} are not held under"
                    f" request {request_id!r} ({outside.size} ID(s))",
                    field=where,
                    fix="gather only the remote kernel blocks of the held request",
                )
            out.append(arr)
        return out

    async def gather(
        self,
        request_id: str,
        reader: str,
        kernel_ids: Sequence[Sequence[int]],
        *,
        release: Sequence[int] = (),
        timeout_s: float | None = None,
    ) -> Grant:
        """Check, wait for a slot (up to ``timeout_s``), gather, answer the slot."""
        self.release(request_id, reader, release)
        ids = self._check(request_id, kernel_ids)
        _, total = span_offsets([int(a.size) for a in ids], self.copier.row_bytes)
        if total == 0:
            raise InvalidRequest(
                "nothing to gather: every group's list is empty", field="kernel_block_ids"
            )
        if total > self.ring.info.chunk_bytes:
            raise InvalidRequest(
                f"the chunk is {total} bytes, a staging slot here holds"
                f" {self.ring.info.chunk_bytes}",
                field="kernel_block_ids",
                fix="cut chunks by the chunk_bytes this daemon advertises in its handshake",
            )
        try:
            slot = await asyncio.wait_for(self.ring.take(), timeout=timeout_s)
        except TimeoutError:
            raise ResourceExhausted(
                f"no staging slot became free within {timeout_s:.3f}s"
                f" ({self.ring.info.chunks} slots, {self.granted} granted)",
                fix="retry later, or raise transfer.staging_chunks on the owner",
            ) from None
        loop = asyncio.get_running_loop()
        held = _Held(request_id, reader, loop.call_later(self.grant_timeout_s, self._expire, slot))
        self._grants[slot] = held
        work = asyncio.ensure_future(
            asyncio.to_thread(self.copier.gather, ids, self.ring.view(slot, total))
        )
        try:
            seconds = await asyncio.shield(work)
        except asyncio.CancelledError:
            # The caller went away; the thread still writes the slot: free it when it ends.
            held.revoked = True
            work.add_done_callback(lambda _: self._drop(slot))
            raise
        except BaseException:
            self._drop(slot)
            raise
        held.busy = False
        if held.revoked or self.leases.get(request_id) is None:
            self._drop(slot)
            raise LeaseRefused(
                f"the lease of {request_id!r} ended during the gather",
                field="request_id",
                fix="hold the request again and retry the pull",
            )
        return Grant(slot, self.ring.info.slot_offset(slot), total, seconds)

    def release(self, request_id: str, reader: str, slots: Sequence[int]) -> int:
        """Free ``slots`` granted to ``reader`` for ``request_id``; others are ignored."""
        n = 0
        for s in slots:
            h = self._grants.get(int(s))
            if h is not None and not h.busy and (h.request_id, h.reader) == (request_id, reader):
                self._drop(int(s))
                n += 1
        return n

    def _drop(self, slot: int) -> None:
        h = self._grants.pop(slot, None)
        if h is not None:
            h.timer.cancel()
            self.ring.give(slot)

    def _reclaim(self, slot: int, why: str) -> None:
        h = self._grants.get(slot)
        if h is None:
            return
        log.info(
            "staging slot reclaimed",
            extra=kv(slot=slot, request_id=h.request_id, reader=h.reader, reason=why),
        )
        if h.busy:
            h.revoked = True  # the gather thread still writes it; freed when it ends
        else:
            self._drop(slot)

    def _expire(self, slot: int) -> None:
        self._reclaim(slot, f"grant timeout {self.grant_timeout_s}s")

    def _lease_ended(self, request_id: str) -> None:
        for slot, h in list(self._grants.items()):
            if h.request_id == request_id:
                self._reclaim(slot, "lease ended")
