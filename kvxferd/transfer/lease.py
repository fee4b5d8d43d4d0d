"""A lease and its shares, as values: what the owner holds for readers, and what it tells
them (:class:`LeaseView`) and the engine (:class:`Released`). The rules that change them are
:class:`~kvxferd.transfer.leases.LeaseTable`'s."""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvxferd.errors import InvalidRequest, LeaseRefused, NotFound

Int64Array = npt.NDArray[np.int64]


class ReleaseReason(enum.Enum):
    DONE = "DONE"  # every expected reader reported completion
    EXPIRED = "EXPIRED"  # the TTL passed first
    CANCELLED = "CANCELLED"  # the engine, an operator or every reader gave the blocks up
    ENGINE_DETACHED = "ENGINE_DETACHED"  # the engine detached or died; the pool is gone


class ShareState(enum.Enum):
    READING = "READING"  # confirmed; the reader may be reading now
    DONE = "DONE"  # the reader finished reading
    GAVE_UP = "GAVE_UP"  # the reader let go without (completely) reading
    LAPSED = "LAPSED"  # the reader went silent past its share's expiry (or restarted)
    DECLINED = "DECLINED"  # the reader gave its place up without confirming (DeclineLease)


@dataclass
class Share:
    """One confirmed reader's part of a lease."""

    reader: str
    ticket: int
    expires_at: float
    state: ShareState = ShareState.READING
    granted_at: float = 0.0  # the table's clock when the share was granted


@dataclass
class Lease:
    request_id: str
    kernel_blocks: tuple[Int64Array, ...]
    readers: int
    expires_at: float
    ttl_s: float
    shares: dict[str, Share] = field(default_factory=dict)
    cancelled: ReleaseReason | None = None

    @property
    def confirmations(self) -> int:
        return len(self.shares)

    @property
    def readers_done(self) -> int:
        return sum(1 for s in self.shares.values() if s.state is ShareState.DONE)

    @property
    def reading(self) -> int:
        return sum(1 for s in self.shares.values() if s.state is ShareState.READING)

    @property
    def reading_until(self) -> float:
        """When the last share still reading expires (0.0 when none is): its reader trusts
        the blocks until then."""
        live = [s.expires_at for s in self.shares.values() if s.state is ShareState.READING]
        return max(live, default=0.0)


@dataclass(frozen=True)
class LeaseView:
    """A snapshot of a lease for one reader (what the Peer service answers)."""

    request_id: str
    readers: int
    confirmations: int
    readers_done: int
    expires_at: float  # the lease's, or the reader's share's when it has one
    ticket: int = 0


@dataclass(frozen=True)
class Released:
    """A lease that ended: its blocks may now be freed by the engine."""

    request_id: str
    reason: ReleaseReason
    kernel_blocks: tuple[Int64Array, ...]
    readers_done: int
    readers: int


def new_ticket() -> int:
    """A share's ticket: random, odd (never 0, which means "no share")."""
    return secrets.randbits(63) | 1


def lease_view(lease: Lease, share: Share | None) -> LeaseView:
    """``lease`` as ``share``'s reader sees it (the lease itself when ``share`` is None)."""
    return LeaseView(
        request_id=lease.request_id,
        readers=lease.readers,
        confirmations=lease.confirmations,
        readers_done=lease.readers_done,
        expires_at=share.expires_at if share else lease.expires_at,
        ticket=share.ticket if share else 0,
    )


def checked_ttl(ttl_s: float, max_ttl_s: float, what: str, key: str) -> float:
    """``ttl_s`` if it is in (0, ``max_ttl_s``]; else the refusal naming ``key``."""
    if not 0 < ttl_s <= max_ttl_s:
        most = int(max_ttl_s * 1000)
        raise InvalidRequest(
            f"{what} of {round(ttl_s * 1000)} ms is outside (0, {most}] ms",
            field=key,
            fix=f"ask for at most {most} ms (this owner's longest lease)",
        )
    return ttl_s


def share_ended(request_id: str, state: ShareState) -> LeaseRefused:
    """The refusal for a reader whose share of ``request_id`` already ended in ``state``."""
    return LeaseRefused(
        f"this reader's share of {request_id!r} already ended ({state.value})",
        field="request_id",
        fix="do not read: hold the request again",
    )


def place_refusal(lease: Lease) -> LeaseRefused | None:
    """Why a reader without a share may not take a place in ``lease`` now (None: it may)."""
    if lease.cancelled is not None:
        return LeaseRefused(
            f"the owner cancelled the lease of {lease.request_id!r} ({lease.cancelled.value});"
            " its blocks are about to be reused",
            field="request_id",
            fix="do not read: re-run the prefill",
        )
    if len(lease.shares) >= lease.readers:
        return LeaseRefused(
            f"the lease of {lease.request_id!r} was held for {lease.readers} reader(s) and all"
            " of them have confirmed (or declined)",
            field="request_id",
            fix="hold the request with readers = the number of decode ranks that read it",
        )
    return None


def declined(lease: Lease, reader: str, now: float) -> Share:
    """``reader`` gives up its place in ``lease`` without reading: a DECLINED share takes one
    expected place, a share still READING ends as GAVE_UP, an ended one stays as it is. Refused
    once ``reader`` read, or when every place is taken by others."""
    share = lease.shares.get(reader)
    if share is None:
        if len(lease.shares) >= lease.readers:
            raise place_refusal(lease) or share_ended(lease.request_id, ShareState.DECLINED)
        share = lease.shares[reader] = Share(reader, 0, now, ShareState.DECLINED)
    elif share.state is ShareState.DONE:
        raise share_ended(lease.request_id, share.state)
    elif share.state is ShareState.READING:
        share.state = ShareState.GAVE_UP
    return share


def declined_gone(request_id: str, reason: ReleaseReason | None) -> LeaseView:
    """A decline of ``request_id``, which no lease holds here. One released before (``reason``,
    remembered) is answered as released: its blocks are held for no reader, which is all a
    decline asks (who read it is not remembered: the view counts no reader). One never held,
    or released so long ago that it was forgotten, is refused."""
    if reason is None:
        raise not_held(request_id, None)
    return LeaseView(request_id, readers=0, confirmations=0, readers_done=0, expires_at=0.0)


def not_held(request_id: str, reason: ReleaseReason | None) -> LeaseRefused | NotFound:
    """The refusal for a request not held here: never held (``reason`` None), or released."""
    if reason is None:
        return NotFound(
            f"request {request_id!r} is not held here (never held, or released long ago)",
            field="request_id",
            fix="the prefill engine must Hold the request before the decode side reads it",
        )
    return LeaseRefused(
        f"lease for request {request_id!r} was released ({reason.value}); its blocks may be reused",
        field="request_id",
        fix="do not read: re-run the prefill (or hold with a longer TTL)",
    )


__all__ = [
    "Lease",
    "LeaseView",
    "ReleaseReason",
    "Released",
    "Share",
    "ShareState",
    "checked_ttl",
    "declined",
    "declined_gone",
    "lease_view",
    "new_ticket",
    "not_held",
    "place_refusal",
    "share_ended",
]
