"""Owner-side (prefill) lease table: blocks held for readers until read, released, or expired.

Pure and clock-injected: no NIXL, no asyncio. A lease holds a request's kernel block IDs per KV
group for ``readers`` expected readers. A reader calls :meth:`LeaseTable.confirm_and_extend`
before its READ; a refusal (:class:`LeaseRefused`) means the blocks may already be reused and
nothing may be read. Each reader's completion notification is counted once (by reader name);
the last one releases the lease. :meth:`LeaseTable.reap` releases expired leases by a full scan.
Every release is reported once to the ``on_release`` callbacks with its reason.

Thread-safe: the NIXL thread counts notifications while the service loop holds and confirms.
Callbacks run with no lock held, on the thread that caused the release.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from kvxferd.errors import AlreadyExists, InvalidRequest, LeaseRefused

log = logging.getLogger(__name__)

Int64Array = npt.NDArray[np.int64]
Clock = Callable[[], float]


class ReleaseReason(enum.Enum):
    DONE = "DONE"  # every expected reader reported completion
    EXPIRED = "EXPIRED"  # the TTL passed first
    CANCELLED = "CANCELLED"  # the engine or an operator gave the blocks up
    ENGINE_DETACHED = "ENGINE_DETACHED"  # the engine detached or died; the pool is gone


@dataclass(frozen=True)
class Lease:
    request_id: str
    kernel_blocks: tuple[Int64Array, ...]
    readers: int
    expires_at: float
    ttl_s: float
    done_readers: frozenset[str] = frozenset()
    confirmations: int = 0


@dataclass(frozen=True)
class Released:
    """A lease that ended: its blocks may now be freed by the engine."""

    request_id: str
    reason: ReleaseReason
    kernel_blocks: tuple[Int64Array, ...]
    readers_done: int
    readers: int


ReleaseCallback = Callable[[Released], None]


class LeaseTable:
    """Leases by request ID. ``clock`` is monotonic seconds (injected for tests)."""

    def __init__(
        self,
        *,
        clock: Clock = time.monotonic,
        max_ttl_s: float = 600.0,
        remember_released: int = 4096,
    ) -> None:
        self._clock = clock
        self._max_ttl_s = max_ttl_s
        self._leases: dict[str, Lease] = {}
        self._ended: OrderedDict[str, ReleaseReason] = OrderedDict()
        self._remember = remember_released
        self._lock = threading.Lock()
        self._callbacks: list[ReleaseCallback] = []

    def subscribe(self, callback: ReleaseCallback) -> None:
        self._callbacks.append(callback)

    def unsubscribe(self, callback: ReleaseCallback) -> None:
        self._callbacks = [c for c in self._callbacks if c is not callback]

    def __len__(self) -> int:
        return len(self._leases)

    def get(self, request_id: str) -> Lease | None:
        return self._leases.get(request_id)

    def _ttl(self, ttl_s: float) -> float:
        if not 0 < ttl_s <= self._max_ttl_s:
            raise InvalidRequest(
                f"lease TTL {ttl_s}s is outside (0, {self._max_ttl_s}]", field="ttl_s"
            )
        return ttl_s

    def hold(
        self,
        request_id: str,
        kernel_blocks: Sequence[npt.ArrayLike],
        *,
        readers: int,
        ttl_s: float,
    ) -> Lease:
        """Hold ``kernel_blocks`` (one array per KV group) for ``readers`` readers."""
        if not request_id:
            raise InvalidRequest("request ID must not be empty", field="request_id")
        if readers < 1:
            raise InvalidRequest(f"expected readers must be >= 1, got {readers}", field="readers")
        ttl = self._ttl(ttl_s)
        blocks = tuple(np.asarray(b, dtype=np.int64).copy() for b in kernel_blocks)
        with self._lock:
            if request_id in self._leases:
                raise AlreadyExists(
                    f"request {request_id!r} already holds a lease", field="request_id"
                )
            lease = Lease(request_id, blocks, readers, self._clock() + ttl, ttl)
            self._leases[request_id] = lease
            self._ended.pop(request_id, None)
        log.info(
            "event=lease_held request=%s readers=%d ttl_s=%.3f groups=%d blocks=%d",
            request_id,
            readers,
            ttl,
            len(blocks),
            sum(b.size for b in blocks),
        )
        return lease

    def confirm_and_extend(self, request_id: str, ttl_s: float | None = None) -> Lease:
        """A reader is about to read: refuse if the lease is gone, else push its expiry out."""
        expired: Released | None = None
        with self._lock:
            lease = self._leases.get(request_id)
            now = self._clock()
            if lease is not None and now >= lease.expires_at:
                expired = self._end(lease, ReleaseReason.EXPIRED)
                lease = None
            if lease is not None:
                ttl = lease.ttl_s if ttl_s is None else self._ttl(ttl_s)
                lease = replace(
                    lease,
                    expires_at=max(lease.expires_at, now + ttl),
                    confirmations=lease.confirmations + 1,
                )
                self._leases[request_id] = lease
            reason = self._ended.get(request_id)
        if expired is not None:
            self._notify([expired])
        if lease is None:
            why = f"was released ({reason.value})" if reason else "is unknown"
            raise LeaseRefused(
                f"lease for request {request_id!r} {why}; its blocks may be reused",
                field="request_id",
                fix="do not read: re-run the prefill (or hold with a longer TTL)",
            )
        return lease

    def complete(self, request_id: str, reader: str) -> Released | None:
        """Count ``reader``'s completion; returns the release when it was the last one."""
        done: Released | None = None
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                log.info("event=lease_late_completion request=%s reader=%s", request_id, reader)
                return None
            if reader in lease.done_readers:
                log.warning(
                    "event=lease_duplicate_completion request=%s reader=%s", request_id, reader
                )
                return None
            lease = replace(lease, done_readers=lease.done_readers | {reader})
            self._leases[request_id] = lease
            if len(lease.done_readers) >= lease.readers:
                done = self._end(lease, ReleaseReason.DONE)
        if done is not None:
            self._notify([done])
        return done

    def cancel(self, request_id: str, reason: ReleaseReason = ReleaseReason.CANCELLED) -> Released:
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                raise LeaseRefused(f"no lease for request {request_id!r}", field="request_id")
            rel = self._end(lease, reason)
        self._notify([rel])
        return rel

    def reap(self) -> list[Released]:
        """Release every lease whose TTL has passed (a full scan)."""
        with self._lock:
            now = self._clock()
            out = [
                self._end(lease, ReleaseReason.EXPIRED)
                for lease in list(self._leases.values())
                if now >= lease.expires_at
            ]
        self._notify(out)
        return out

    def _end(self, lease: Lease, reason: ReleaseReason) -> Released:
        del self._leases[lease.request_id]
        self._ended[lease.request_id] = reason
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)
        return Released(
            lease.request_id, reason, lease.kernel_blocks, len(lease.done_readers), lease.readers
        )

    def _notify(self, released: list[Released]) -> None:
        for rel in released:
            log.info(
                "event=lease_released request=%s reason=%s readers_done=%d/%d",
                rel.request_id,
                rel.reason.value,
                rel.readers_done,
                rel.readers,
            )
            for cb in self._callbacks:
                try:
                    cb(rel)
                except Exception:
                    log.exception("event=lease_callback_error request=%s", rel.request_id)
