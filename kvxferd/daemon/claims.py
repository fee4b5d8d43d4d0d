"""At most one pull of this daemon reads an owner's request at a time.

An owner gives each reader (each handshake session, so each decode daemon) one share of a
request's lease, whatever number of pulls that reader runs: a second ConfirmLease from the same
reader renews the share it has and answers with the same ticket (kvxferd/transfer/leases.py).
Two pulls of one request from one daemon would therefore read under one share, and the first
to end would end it for both: its READ_DONE (or its release) lets the owner hand the blocks back
to its engine while the other pull still reads them, and that pull would then end DONE with
whatever the engine wrote there.

:class:`ReadClaims` keeps, per (owner address, request ID), the pull that reads it, from before
its confirmation is sent until it ends. A second pull meanwhile is refused (``LeaseRefused``,
naming the pull to wait for). When a pull ends its share (read, or cancelled: the owner then
refuses any further confirmation from this reader), later pulls of that request are refused
here for :data:`ENDED_TTL_S`, as the owner would refuse them, since the READ_DONE notification
may still be on its way and a confirmation sent now could overtake it. A pull that ends keeping
its share (FAILED, EXPIRED: the share lapses on the owner unless a retry confirms it) frees
the request at once, so the scheduler can retry the same lease from this daemon.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvxferd.errors import DeadlineExceeded, LeaseRefused

# How long a request whose share this daemon ended stays refused here. Past it, a confirmation
# reaches the owner long after the READ_DONE or the release it could have overtaken, and the
# owner refuses it itself.
ENDED_TTL_S = 600.0
# And how many such requests it remembers (~0.4 KB each): past it the oldest go first, so at
# 1,000 pulls a second each is still kept for two minutes, far longer than a notification
# takes, and the memory stays under ~50 MB whatever the pull rate (docs/operations.md).
MAX_ENDED = 131072

Key = tuple[str, str]  # (the owner's address, the request ID)

# The claim a DeclinePull takes (kvxferd/daemon/decline.py); no transfer ID has a space.
DECLINE_CLAIM = "DeclinePull "


class ReadClaims:
    """The pulls reading each (owner, request) of this daemon, and the requests whose share it
    ended recently."""

    def __init__(
        self,
        *,
        ended_ttl_s: float = ENDED_TTL_S,
        max_ended: int = MAX_ENDED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl = ended_ttl_s
        self._max_ended = max_ended
        self._clock = clock
        self._reading: dict[Key, str] = {}
        self._ended: dict[Key, tuple[float, str]] = {}  # in order of expiry (one TTL for all)

    def claim(self, address: str, request_id: str, transfer_id: str) -> bool:
        """``transfer_id`` is about to confirm and read ``request_id`` on ``address``: True
        once claimed; False when a pull of that same transfer ID claimed it first (a twin
        StartPull, which must confirm nothing and answer with that pull). Raises
        :class:`LeaseRefused` when another pull of this daemon reads it, or one ended its
        share."""
        key = (address, request_id)
        other = self._reading.get(key)
        if other == transfer_id:
            return False
        if other == DECLINE_CLAIM:
            raise LeaseRefused(
                f"request {request_id!r} on {address} is being declined by this daemon",
                field="request_id",
                fix="do not pull a request you declined: hold the prompt again on the prefill"
                " daemon under a new request ID",
            )
        if other is not None:
            raise LeaseRefused(
                f"request {request_id!r} on {address} is being read by transfer {other!r} of"
                " this daemon; a second pull would read under the same lease share, and the"
                " first to end could release the blocks under the other",
                field="request_id",
                fix=f"wait for transfer {other} to end (WatchTransfers, or StartPull with"
                " wait) and pull again only if it failed",
            )
        self._expire()
        ended = self._ended.get(key)
        if ended is not None and ended[1] == DECLINE_CLAIM:
            raise LeaseRefused(
                f"this daemon declined request {request_id!r} on {address} (DeclinePull); the"
                " owner no longer counts it among the request's readers",
                field="request_id",
                fix="hold the prompt again on the prefill daemon under a new request ID and pull"
                " that",
            )
        if ended is not None:
            raise LeaseRefused(
                f"transfer {ended[1]!r} of this daemon already ended its share of request"
                f" {request_id!r} on {address} (it read the blocks, or was cancelled); the"
                " owner refuses a second read by the same reader",
                field="request_id",
                fix="use what that pull read, or hold the prompt again on the prefill daemon under"
                " a new request ID and pull that",
            )
        self._reading[key] = transfer_id
        return True

    def release(self, address: str, request_id: str, transfer_id: str, *, ended: bool) -> None:
        """``transfer_id`` stopped reading (it ended, or will not run); ``ended``: it ended
        its share, so later pulls of the request are refused for a while."""
        key = (address, request_id)
        if self._reading.get(key) != transfer_id:
            return
        del self._reading[key]
        if ended:
            self._expire()
            self._ended.pop(key, None)  # re-inserted last: the dict stays in expiry order
            self._ended[key] = (self._clock() + self._ttl, transfer_id)
            if len(self._ended) > self._max_ended:  # the oldest first
                del self._ended[next(iter(self._ended))]

    async def twin(
        self,
        address: str,
        request_id: str,
        transfer_id: str,
        started: Callable[[], object],
        deadline: float,
    ) -> None:
        """Wait while a twin StartPull of ``transfer_id`` holds the claim and its pull has not
        ``started`` (returns a truthy value once it exists); past ``deadline`` (monotonic),
        :class:`DeadlineExceeded`."""
        while self._reading.get((address, request_id)) == transfer_id and not started():
            if self._clock() > deadline:
                raise DeadlineExceeded(
                    f"transfer {transfer_id!r} did not start within the pull's deadline",
                    fix="raise deadline_ms",
                )
            await asyncio.sleep(1e-3)

    def ended_by(self, address: str, request_id: str) -> str | None:
        """The transfer ID (or :data:`DECLINE_CLAIM`) that recently ended this daemon's share
        of ``request_id`` on ``address``; None if none did."""
        self._expire()
        ended = self._ended.get((address, request_id))
        return None if ended is None else ended[1]

    def reading(self, address: str, request_id: str) -> str | None:
        return self._reading.get((address, request_id))

    @property
    def ended(self) -> int:
        """Requests whose share ended recently (refused here until their TTL passes)."""
        return len(self._ended)

    def _expire(self) -> None:
        now = self._clock()
        while self._ended:
            key, (until, _) = next(iter(self._ended.items()))
            if until > now:
                return
            del self._ended[key]


__all__ = ["ENDED_TTL_S", "MAX_ENDED", "ReadClaims"]
