"""Owner-side (prefill) lease table: blocks held for readers, released per reader.

Pure and clock-injected: no NIXL, no asyncio. A lease holds a request's kernel block IDs per KV
group for ``readers`` expected readers. Each reader that is about to READ confirms the lease
(:meth:`LeaseTable.confirm`) and gets a *share*: its own expiry and a random ticket. From then
on only that reader can end its share, by the NIXL notification carrying its ticket
(:meth:`LeaseTable.notified`) or by :meth:`LeaseTable.finish` under its own identity; a share
that is not renewed lapses at its own expiry. A reader that will not read after all gives its
place up (:meth:`LeaseTable.decline`).

The blocks go back to the engine (one :class:`Released` to the ``on_release`` callbacks) only
when no share is still reading, and then when

* every expected reader ended its share (``DONE`` if all read, else ``CANCELLED``),
* the owner cancelled the lease (:meth:`LeaseTable.cancel`; no new confirmations meanwhile), or
* the TTL passed (``EXPIRED``).

An engine that detached (``ENGINE_DETACHED``) ends the lease at once; its memory is kept
mapped until the readers' shares would have expired (:meth:`LeaseTable.reading_left`).

A reader's identity is whatever key the caller passes (the daemon passes the authenticated
peer session, never a field of the request). Thread-safe: the NIXL thread reports
notifications while the service loop holds and confirms; callbacks run with no lock held, on
the thread that caused the release.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt

from kvxferd.errors import AlreadyExists, InvalidRequest, LeaseRefused, NotFound, PermissionDenied
from kvxferd.logs import kv
from kvxferd.transfer.due import ReadDue
from kvxferd.transfer.lease import (
    Lease,
    LeaseView,
    Released,
    ReleaseReason,
    Share,
    ShareState,
    checked_ttl,
    declined,
    declined_gone,
    lease_view,
    new_ticket,
    not_held,
    place_refusal,
    share_ended,
)

log = logging.getLogger(__name__)

Int64Array = npt.NDArray[np.int64]
Clock = Callable[[], float]
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
        self.max_ttl_s = max_ttl_s
        self._leases: dict[str, Lease] = {}
        self._ended: OrderedDict[str, ReleaseReason] = OrderedDict()
        self._remember = remember_released
        self._lock = threading.Lock()
        self._callbacks: list[ReleaseCallback] = []
        self.stray_notifications = 0
        self.due = ReadDue(clock)  # the READ_DONEs due (kvxferd/transfer/due.py)

    def subscribe(self, callback: ReleaseCallback) -> None:
        self._callbacks.append(callback)

    def unsubscribe(self, callback: ReleaseCallback) -> None:
        self._callbacks = [c for c in self._callbacks if c is not callback]

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def reading_shares(self) -> int:
        with self._lock:
            return sum(lease.reading for lease in self._leases.values())

    def _ttl(self, ttl_s: float, what: str = "lease TTL", key: str = "ttl_ms") -> float:
        return checked_ttl(ttl_s, self.max_ttl_s, what, key)

    # -- owner ------------------------------------------------------------------------------

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
                    f"request {request_id!r} already holds a lease",
                    field="request_id",
                    fix="hold a request ID once: it stays held until its readers are done or its"
                    " TTL passes (WatchReleases says when); give a new request its own ID",
                )
            lease = Lease(request_id, blocks, readers, self._clock() + ttl, ttl)
            self._leases[request_id] = lease
            self._ended.pop(request_id, None)
        return lease

    def cancel(self, request_id: str, reason: ReleaseReason = ReleaseReason.CANCELLED) -> bool:
        """The owner gives the blocks up. Returns whether they were released now; otherwise they
        are released when the last reader still reading ends (or its share lapses).
        ``ENGINE_DETACHED`` releases at once (the detach keeps the memory mapped while a
        share read: :meth:`reading_left`)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                raise self._missing(request_id)
            lease.cancelled = lease.cancelled or reason
            if reason is ReleaseReason.ENGINE_DETACHED:
                for s in lease.shares.values():
                    if s.state is ShareState.READING:
                        s.state = ShareState.LAPSED
            rel = self._settle(lease, self._clock())
        self._notify([rel] if rel else [])
        return rel is not None

    # -- readers ----------------------------------------------------------------------------

    def confirm(self, request_id: str, reader: str, extend_s: float) -> LeaseView:
        """``reader`` is about to read: give it a share (or renew the one it has) that expires
        ``extend_s`` from now. Refused when the lease is gone, cancelled, or every expected
        reader already has a share."""
        extend = self._ttl(extend_s, "share extension", "extend_ms")
        now = self._clock()
        with self._lock:
            lease, rel = self._live(request_id, now)
            if lease is not None:
                share = lease.shares.get(reader)
                new = share is None
                if share is not None and share.state is not ShareState.READING:
                    raise LeaseRefused(
                        f"this reader already ended its share of {request_id!r}"
                        f" ({share.state.value})",
                        field="request_id",
                        fix="a reader confirms a lease once per read; hold the request again",
                    )
                if share is None:
                    refusal = place_refusal(lease)
                    if refusal is not None:
                        raise refusal
                    share = Share(reader, new_ticket(), now + extend, granted_at=now)
                    lease.shares[reader] = share
                else:
                    share.expires_at = max(share.expires_at, now + extend)
                view = lease_view(lease, share)
                self.due.granted(share, now, new=new)
        self._notify([rel] if rel else [])
        if lease is None:
            raise self._missing(request_id)
        return view

    def extend(self, request_id: str, reader: str, extend_s: float) -> LeaseView:
        """Push ``reader``'s own share out; only a reader still reading may."""
        extend = self._ttl(extend_s, "extension", "extend_ms")
        now = self._clock()
        with self._lock:
            lease, rel = self._live(request_id, now)
            share = None if lease is None else self._own_share(lease, reader)
            if lease is not None and share is not None:
                share.expires_at = max(share.expires_at, now + extend)
                view = lease_view(lease, share)
        self._notify([rel] if rel else [])
        if lease is None or share is None:
            raise self._missing(request_id)
        return view

    def finish(self, request_id: str, reader: str, *, done: bool) -> tuple[LeaseView, bool]:
        """``reader`` ends its own share: read (``done``) or gave up. Returns the lease as it
        is now and whether the blocks were released by this."""
        now = self._clock()
        with self._lock:
            lease, rel = self._live(request_id, now)
            share = None if lease is None else self._own_share(lease, reader)
            if lease is not None and share is not None:
                share.state = ShareState.DONE if done else ShareState.GAVE_UP
                view = lease_view(lease, share)
                rel = self._settle(lease, now)
        self._notify([rel] if rel else [])
        if lease is None or share is None:
            raise self._missing(request_id)
        return view, rel is not None

    def decline(self, request_id: str, reader: str) -> tuple[LeaseView, bool]:
        """``reader`` will not read after all (:func:`~kvxferd.transfer.lease.declined`): the
        blocks are released once the other readers end, not at the TTL. Returns the lease as
        it is now and whether it is released, by this decline or before it (then as
        :func:`~kvxferd.transfer.lease.declined_gone` says; NotFound if never held)."""
        now = self._clock()
        with self._lock:
            lease, rel = self._live(request_id, now)
            if lease is not None:
                view = lease_view(lease, declined(lease, reader, now))
                rel = self._settle(lease, now)
            ended = self._ended.get(request_id)
        self._notify([rel] if rel else [])
        if lease is None:
            return declined_gone(request_id, ended), True
        return view, rel is not None

    def notified(self, request_id: str, ticket: int) -> bool:
        """A READ_DONE notification: counts only with the ticket of a share still reading.
        Anything else (unknown request, wrong or spent ticket) is stray: ignored and counted."""
        now = self._clock()
        with self._lock:
            lease = self._leases.get(request_id)
            share = None
            if lease is not None and ticket:
                share = next(
                    (
                        s
                        for s in lease.shares.values()
                        if s.ticket == ticket and s.state is ShareState.READING
                    ),
                    None,
                )
            if lease is None or share is None:
                self.stray_notifications += 1
                return False
            share.state = ShareState.DONE
            self.due.notified(now - share.granted_at)
            rel = self._settle(lease, now)
        self._notify([rel] if rel else [])
        return True

    def renew(self, reader: str, request_ids: Iterable[str], extend_s: float) -> list[str]:
        """Heartbeat: renew ``reader``'s shares of ``request_ids``; returns those it has no
        share still reading in (released, expired, unknown, or never confirmed by it)."""
        now = self._clock()
        lost: list[str] = []
        released: list[Released] = []
        with self._lock:
            for rid in request_ids:
                lease, rel = self._live(rid, now)
                if rel:
                    released.append(rel)
                share = lease.shares.get(reader) if lease is not None else None
                if share is None or share.state is not ShareState.READING:
                    lost.append(rid)
                elif extend_s > 0:
                    share.expires_at = max(share.expires_at, now + extend_s)
        self._notify(released)
        return lost

    def reader_gone(self, reader: str) -> int:
        """``reader`` restarted or was replaced: every share it was reading lapses now."""
        now = self._clock()
        released: list[Released] = []
        n = 0
        with self._lock:
            for lease in list(self._leases.values()):
                share = lease.shares.get(reader)
                if share is not None and share.state is ShareState.READING:
                    share.state = ShareState.LAPSED
                    n += 1
                    rel = self._settle(lease, now)
                    if rel:
                        released.append(rel)
        self._notify(released)
        return n

    def is_reading(self, request_id: str, reader: str) -> bool | None:
        """Whether ``reader`` has a share of ``request_id`` it is reading; None when the lease
        is not held (any more)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return None
            share = lease.shares.get(reader)
            return share is not None and share.state is ShareState.READING

    def reading_left(self, request_ids: Iterable[str]) -> float:
        """Seconds until the last share of ``request_ids`` still reading expires (0.0 when
        none is). Ask before an ``ENGINE_DETACHED`` cancel, which lapses them."""
        with self._lock:
            leases = [lease for r in request_ids if (lease := self._leases.get(r)) is not None]
            until = max((lease.reading_until for lease in leases), default=0.0)
        return max(0.0, until - self._clock())

    def reading(self, reader: str) -> int:
        """How many shares ``reader`` is reading now."""
        with self._lock:
            shares = [lease.shares.get(reader) for lease in self._leases.values()]
            return sum(1 for s in shares if s is not None and s.state is ShareState.READING)

    def reap(self) -> list[Released]:
        """Lapse shares past their expiry and release the leases that can end (a full scan)."""
        now = self._clock()
        with self._lock:
            out = [
                rel for lease in list(self._leases.values()) if (rel := self._settle(lease, now))
            ]
        self._notify(out)
        return out

    def ended(self, request_id: str) -> ReleaseReason | None:
        return self._ended.get(request_id)

    def get(self, request_id: str) -> Lease | None:
        return self._leases.get(request_id)

    # -- internals (lock held) --------------------------------------------------------------

    def _live(self, request_id: str, now: float) -> tuple[Lease | None, Released | None]:
        lease = self._leases.get(request_id)
        if lease is None:
            return None, None
        rel = self._settle(lease, now)
        return (None, rel) if rel else (lease, None)

    def _own_share(self, lease: Lease, reader: str) -> Share | None:
        share = lease.shares.get(reader)
        if share is None:
            raise PermissionDenied(
                f"this caller has not confirmed the lease of {lease.request_id!r}",
                field="request_id",
                fix="only a reader that confirmed a lease (ConfirmLease) may extend or release"
                " its own share",
            )
        if share.state is not ShareState.READING:
            raise share_ended(lease.request_id, share.state)
        return share

    def _settle(self, lease: Lease, now: float) -> Released | None:
        for s in lease.shares.values():
            if s.state is ShareState.READING and now >= s.expires_at:
                s.state = ShareState.LAPSED
                log.warning(
                    "lease share lapsed", extra=kv(request_id=lease.request_id, reader=s.reader)
                )
        if lease.reading:
            return None
        if lease.cancelled is not None:
            return self._end(lease, lease.cancelled)
        if len(lease.shares) >= lease.readers:
            all_read = all(s.state is ShareState.DONE for s in lease.shares.values())
            return self._end(lease, ReleaseReason.DONE if all_read else ReleaseReason.CANCELLED)
        if now >= lease.expires_at:
            return self._end(lease, ReleaseReason.EXPIRED)
        return None

    def _missing(self, request_id: str) -> LeaseRefused | NotFound:
        return not_held(request_id, self._ended.get(request_id))

    def _end(self, lease: Lease, reason: ReleaseReason) -> Released:
        del self._leases[lease.request_id]
        self._ended[lease.request_id] = reason
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)
        return Released(
            lease.request_id, reason, lease.kernel_blocks, lease.readers_done, lease.readers
        )

    def _notify(self, released: list[Released]) -> None:
        for rel in released:
            for cb in self._callbacks:
                try:
                    cb(rel)
                except Exception:
                    log.exception(
                        "lease release callback failed", extra=kv(request_id=rel.request_id)
                    )


__all__ = ["Lease", "LeaseTable", "LeaseView", "ReleaseReason", "Released"]
