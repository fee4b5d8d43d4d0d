"""DeclinePull: this daemon will not pull a request a peer holds for it after all.

A decode request can end before its pull starts (the client went away, the scheduler gave up):
without a word from the reader, the owner keeps the request's blocks until its lease's TTL
passes. A decline tells the owner now (Peer ``DeclineLease``): this daemon gives up its place
among the request's expected readers, so the owner frees the blocks as soon as no other
expected reader is left. A request the owner released already (its TTL passed, its other
readers ended) is answered as released: nothing is held for this daemon, which is all a
decline asks.

A decline must never end a share a pull of this daemon is still reading under (the owner
would free the blocks under its READ), so it takes the request's read claim like a pull does
(:class:`~kvxferd.daemon.claims.ReadClaims`): refused while a pull reads it or once a pull of
it ended here; once declined, a later StartPull of the request is refused here as the owner
would refuse it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvxferd.daemon.claims import DECLINE_CLAIM
from kvxferd.daemon.links import handshaken
from kvxferd.daemon.peers import PeerLink
from kvxferd.daemon.pulls import check_target
from kvxferd.daemon.reader import Reader
from kvxferd.errors import (
    InvalidRequest,
    LeaseRefused,
    NotFound,
    PermissionDenied,
    UnknownSession,
)
from kvxferd.logs import kv
from kvxferd.v1 import peer_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Declined:
    """The owner's lease after a decline."""

    released: bool
    readers_expected: int
    readers_confirmed: int


async def decline(
    reader: Reader, peer_address: str, request_id: str, deadline_s: float
) -> Declined:
    """Give up this daemon's place in ``request_id``'s lease on ``peer_address``."""
    check_target(request_id, peer_address, deadline_s, reader.p.limits.max_deadline_s)
    peers = reader.p.peers
    assert peers is not None, "attach_peers() before decline()"
    link = peers.usable(peer_address) or await handshaken(
        peers, peer_address, deadline_s, "decline"
    )
    claims = reader.claims
    ended_by = claims.ended_by(link.address, request_id)
    # A repeated decline finds its own claim ended: it asks the owner again (idempotent there).
    again = ended_by == DECLINE_CLAIM
    if not again:
        _refuse_if_taken(reader, link.address, request_id, ended_by)
        claims.claim(link.address, request_id, DECLINE_CLAIM)
    # Ended unless the owner answered that nothing changed: a decline that may have reached
    # the owner (timed out, cancelled, connection lost) must never be followed by a pull of
    # this daemon, whose confirmation it could overtake and end.
    ended = True
    try:
        resp = await _ask(reader, link, request_id, deadline_s)
    except (LeaseRefused, NotFound):
        ended = False
        if not again:
            raise
        # Declined before. The owner answers a repeat as the lease is, released ones too, so
        # it forgot the request (or is a build that refused released ones): gone either way.
        return Declined(released=True, readers_expected=0, readers_confirmed=0)
    except (InvalidRequest, PermissionDenied, UnknownSession):
        ended = False
        raise
    finally:
        if not again:
            claims.release(link.address, request_id, DECLINE_CLAIM, ended=ended)
    lease = resp.lease
    out = Declined(
        released=lease.state == peer_pb2.LEASE_STATE_RELEASED,
        readers_expected=lease.readers_expected,
        readers_confirmed=lease.readers_confirmed,
    )
    log.info(
        "declined a held request",
        extra=kv(peer=link.address, request_id=request_id, released=out.released),
    )
    return out


def _refuse_if_taken(reader: Reader, address: str, request_id: str, ended_by: str | None) -> None:
    """Refuse a decline while anything of this daemon reads the request, or after a pull of
    it ended its share."""
    other = reader.claims.reading(address, request_id)
    if other == DECLINE_CLAIM:
        raise LeaseRefused(
            f"another DeclinePull of request {request_id!r} on {address} is in flight",
            field="request_id",
            fix="wait for its answer: a decline repeated after that is answered again",
        )
    if other is not None:
        raise LeaseRefused(
            f"transfer {other!r} of this daemon is pulling request {request_id!r} from"
            f" {address}; a decline now could free the blocks under its READ",
            field="request_id",
            fix=f"CancelTransfer {other} (its end gives this daemon's share back), or let it end",
        )
    if ended_by is not None:
        raise LeaseRefused(
            f"transfer {ended_by!r} of this daemon already ended its share of request"
            f" {request_id!r} on {address} (it read the blocks, or was cancelled)",
            field="request_id",
            fix="nothing to decline: the owner releases the blocks as its readers end",
        )


async def _ask(
    reader: Reader, link: PeerLink, request_id: str, deadline_s: float
) -> peer_pb2.DeclineLeaseResponse:
    """DeclineLease; a peer that restarted (it no longer knows our session) is handshaken
    again first, as a pull's confirmation does."""
    try:
        return await link.client.decline(request_id, reader.p.agent_name, deadline_s)
    except UnknownSession:
        link.client.session = ""  # the peer forgot it: take the new handshake's
        await reader.shares.rehandshake(link, "the peer no longer knows our session")
    return await link.client.decline(request_id, reader.p.agent_name, deadline_s)


__all__ = ["Declined", "decline"]
