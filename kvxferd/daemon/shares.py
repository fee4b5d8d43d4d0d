"""The reader's shares of owners' leases: confirming one for a pull, renewing them by
heartbeat while pulls read, and ending them (a NIXL notification once read, or the RPC).

A pull's share is confirmed while it plans (:mod:`kvxferd.daemon.reader`); a peer that
restarted is handshaken again first. While pulls from a peer are in flight, one heartbeat loop
per peer renews their shares; a share the owner lost cancels its pull's read, because the
owner may reuse the blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxferd.daemon.handshake import RemoteDescription
from kvxferd.daemon.parts import Parts
from kvxferd.daemon.peers import LinkState, PeerLink
from kvxferd.daemon.pulls import PullBook, PullState
from kvxferd.errors import (
    DeadlineExceeded,
    KvxferdError,
    LeaseRefused,
    PeerUnavailable,
    UnknownSession,
)
from kvxferd.logs import kv
from kvxferd.peers import compat_digest
from kvxferd.transfer import TransferResult, TransferStatus, notify
from kvxferd.v1 import peer_pb2

log = logging.getLogger(__name__)

Int64Array = npt.NDArray[np.int64]

# ConfirmLease calls per confirmation when calls time out (the pull's deadline bounds them too).
CONFIRM_ATTEMPTS = 4


def _missing(ids: Int64Array, held: Sequence[int]) -> Int64Array:
    """The IDs of ``ids`` not in ``held``, sorted (a set difference; sets beat NumPy's sort
    for the few dozen IDs of a typical pull)."""
    if ids.size <= 256:
        want = ids.tolist()
        if want == held[:]:  # the usual answer: all, in order (the slice: a list, in one call)
            return _NONE
        gone = set(want).difference(held)
        return np.array(sorted(gone), dtype=np.int64)
    have = np.asarray(held, dtype=np.int64)
    if have.shape == ids.shape and np.array_equal(have, ids):  # the usual answer: all, in order
        return _NONE
    return np.setdiff1d(ids, have)


_NONE = np.zeros(0, dtype=np.int64)
_NONE.setflags(write=False)


@dataclass
class Share:
    """This reader's share of an owner's lease, for one pull."""

    ticket: int  # 0: never confirmed
    valid_until: float  # monotonic; the owner may reuse the blocks after it
    address: str
    done: bool = False
    lost: bool = False
    # The owner instance (and registrations) that granted it: only that one holds the blocks.
    remote: RemoteDescription | None = None


_TERMINAL = {
    TransferStatus.DONE: PullState.DONE,
    TransferStatus.FAILED: PullState.FAILED,
    TransferStatus.CANCELLED: PullState.CANCELLED,
    TransferStatus.EXPIRED: PullState.EXPIRED,
}


def outcome(
    result: TransferResult,
    share: Share,
    local_blocks: tuple[Int64Array, ...],
    address: str,
    cancelled: bool,
) -> tuple[PullState, KvxferdError | None, tuple[Int64Array, ...]]:
    """A read's terminal state, error and invalid local blocks, judged against its share. A
    read that ended DONE after its share lapsed, or that ended at all after the owner reported
    the share lost (the heartbeat then stopped it: docs/reliability.md), FAILS listing every
    local block, since the owner may have reused the blocks meanwhile; only a read a caller
    cancelled (``cancelled``) stays CANCELLED."""
    state = _TERMINAL[result.status]
    lapsed = state is PullState.DONE and time.monotonic() > share.valid_until
    if lapsed or (share.lost and not (cancelled and state is PullState.CANCELLED)):
        return (
            PullState.FAILED,
            LeaseRefused(
                f"the lease share on {address} lapsed or was lost before the READ"
                " completed, so the owner may have reused the blocks",
                field="request_id",
                fix="pull again after re-running the prefill; check the peers' heartbeats"
                " (peers.heartbeat_timeout_ms) and load",
            ),
            local_blocks,
        )
    error = result.error or (None if state is PullState.DONE else KvxferdError(result.reason))
    return state, error, result.invalid_blocks


def check_granted_by_loaded(share: Share, loaded: RemoteDescription | None, address: str) -> None:
    """Refuse to READ unless the NIXL peer loaded under the share's agent name now is the
    instance (and registrations) that granted the share: another instance that took over the
    agent name (a restart, possibly at another address, while this one stalled) does not hold
    the request, and a READ to it would end DONE with its bytes."""
    granted = share.remote
    if (
        granted is None
        or loaded is granted
        or (
            loaded is not None
            and loaded.instance_id == granted.instance_id
            and loaded.agent_metadata == granted.agent_metadata
        )
    ):
        return
    raise PeerUnavailable(
        f"the NIXL agent {granted.agent_name!r} now belongs to another instance than"
        f" {granted.instance_id}, which granted this pull's lease share on {address};"
        " nothing was read",
        field="peer_address",
        fix="retry the pull",
    )


def ends_share(held: Share, state: PullState) -> bool:
    """Whether a pull that ended in ``state`` ends its share (:meth:`Shares.settle`): read, or
    given up by a cancel; a FAILED or EXPIRED pull keeps it for a retry."""
    return bool(held.ticket) and (held.done or state is PullState.CANCELLED)


class Shares:
    """This reader's lease shares, by transfer ID, and the per-peer heartbeat loops."""

    def __init__(
        self, parts: Parts, pulls: PullBook, abort: Callable[[str, str], Awaitable[None]]
    ) -> None:
        self.p = parts
        self._pulls = pulls
        self._abort = abort
        self.by_transfer: dict[str, Share] = {}
        self._heartbeats: dict[str, asyncio.Task[None]] = {}

    async def confirm(
        self,
        link: PeerLink,
        request_id: str,
        remote_ids: tuple[Int64Array, ...],
        deadline: float,
    ) -> Share:
        """Confirm our share of the lease. A peer that restarted (it no longer knows our
        session, or answers with another instance) is handshaken again first: its metadata
        changed, and reading with the old would fail or read the wrong memory."""
        assert self.p.peers is not None
        for attempt in (1, 2):
            remote = link.remote
            assert remote is not None
            try:
                resp, sent = await self._ask(link, request_id, deadline)
            except UnknownSession:
                if attempt == 2:
                    raise
                link.client.session = ""  # the peer forgot it: take the new handshake's
                await self.rehandshake(link, "the peer no longer knows our session")
                continue
            if resp.instance_id and resp.instance_id != remote.instance_id:
                if attempt == 1:
                    await self.rehandshake(link, f"the peer is now instance {resp.instance_id}")
                    continue
                raise PeerUnavailable(
                    f"peer {link.address} changed instance while we confirmed",
                    field="peer_address",
                    fix="retry the pull",
                )
            break
        share = Share(resp.ticket, sent + resp.lease.remaining_ms / 1000, link.address)
        # The owner re-registered (its engine re-attached): its regions moved.
        await self.p.peers.refresh(link, resp.lease.registration_generation)
        share.remote = granted = link.remote  # the instance holding the blocks for us
        if granted is None or remote is None or granted.instance_id != remote.instance_id:
            raise PeerUnavailable(
                f"peer {link.address} changed instance while we confirmed",
                field="peer_address",
                fix="retry the pull",
            )
        held = resp.lease.block_ids.groups
        for g, ids in enumerate(remote_ids):
            missing = _missing(ids, held[g].ids if g < len(held) else ())
            if missing.size:
                self.p.spawn(self.release(link, request_id, done=False))
                raise LeaseRefused(
                    f"remote block IDs {missing[:8].tolist()} of group {g} are not held under"
                    f" request {request_id!r} on {link.address}",
                    field=f"remote_block_ids.groups[{g}]",
                    fix="pass exactly the remote_block_ids that Hold returned",
                )
        return share

    async def _ask(
        self, link: PeerLink, request_id: str, deadline: float
    ) -> tuple[peer_pb2.ConfirmLeaseResponse, float]:
        """One ConfirmLease, and when a call times out (a stalled owner or machine; each call
        lasts at most the per-call cap, transfer.handshake_timeout_ms) the same again while the
        pull's deadline allows: the owner renews a share this reader already has instead of
        granting a second one, so asking again is safe. Returns the answer and when the call
        that got it was sent."""
        for attempt in range(1, CONFIRM_ATTEMPTS + 1):
            left = deadline - time.monotonic()
            sent = time.monotonic()
            try:
                resp = await link.client.confirm(
                    request_id,
                    self.p.agent_name,
                    int(min(max(1.0, left), self.p.limits.max_deadline_s) * 1000),
                    left,
                )
                return resp, sent
            except DeadlineExceeded as err:
                if attempt == CONFIRM_ATTEMPTS or deadline - time.monotonic() <= 0:
                    raise
                log.info(
                    "confirming a lease timed out; asking again",
                    extra=kv(
                        peer=link.address, request_id=request_id, attempt=attempt, error=str(err)
                    ),
                )
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def rehandshake(self, link: PeerLink, why: str) -> None:
        assert self.p.peers is not None
        log.info("peer restarted; handshaking again", extra=kv(peer=link.address, why=why))
        before = link.remote
        await self.p.peers.invalidate(link.address, why, LinkState.STALE)
        await self.p.peers.ready(link.address)
        after = link.remote
        if (
            before is not None
            and after is not None
            and (
                compat_digest(before.info.spec) != compat_digest(after.info.spec)
                or (before.info.tp_rank, before.info.tp_size)
                != (after.info.tp_rank, after.info.tp_size)
            )
        ):
            raise PeerUnavailable(
                f"peer {link.address} restarted with a different KV layout or TP rank than this"
                " pull was planned for",
                field="peer_address",
                fix="start the pull again: it is planned against the new layout",
            )

    async def notify_done(self, link: PeerLink, request_id: str, ticket: int) -> None:
        """Tell the owner we read (the NIXL notification with our ticket; the RPC if NIXL
        cannot deliver it)."""
        agent = link.remote.agent_name if link.remote else ""
        try:
            note = notify.encode(request_id, ticket)
            await asyncio.wrap_future(self.p.engine.notify(agent, note))
        except KvxferdError as err:
            log.info("notification failed; releasing by RPC", extra=kv(error=str(err)))
            await self.release(link, request_id, done=True)

    async def release(self, link: PeerLink, request_id: str, *, done: bool) -> None:
        """Best effort: tell the owner our share ended (it would lapse anyway)."""
        try:
            await link.client.release(request_id, self.p.agent_name, done=done)
        except KvxferdError as err:
            log.info(
                "releasing a lease share failed (it lapses on the owner)",
                extra=kv(peer=link.address, request_id=request_id, error=str(err)),
            )

    def settle(
        self, link: PeerLink, request_id: str, held: Share, *, notify: bool, state: PullState
    ) -> None:
        """A pull ended: report our share read (``notify``), or end it now when it was read
        without a notification or a caller gave the pull up. A FAILED or EXPIRED pull keeps
        it until it lapses (heartbeat timeout), so the scheduler can retry the same lease from
        this daemon meanwhile."""
        if not ends_share(held, state):
            return
        # Started now (eagerly where Python allows): the owner hears of it before this
        # daemon's books for the pull are done (kvxferd/daemon/reader.py, _settle).
        if held.done and notify:
            self.p.spawn(self.notify_done(link, request_id, held.ticket), now=True)
        else:
            self.p.spawn(self.release(link, request_id, done=held.done), now=True)

    def ensure_heartbeat(self, link: PeerLink) -> None:
        task = self._heartbeats.get(link.address)
        if task is None or task.done():
            self._heartbeats[link.address] = asyncio.get_running_loop().create_task(
                self._heartbeat_loop(link)
            )

    async def _heartbeat_loop(self, link: PeerLink) -> None:
        """While pulls from ``link`` are in flight, renew their shares and watch for a restart
        or a lost lease; a pull whose share is lost is cancelled (its blocks may be reused)."""
        assert self.p.peers is not None
        interval = self.p.limits.heartbeat_interval_s
        while link.active > 0:
            await asyncio.sleep(interval)
            mine = {
                tid: sh
                for tid, sh in self.by_transfer.items()
                if sh.address == link.address and sh.ticket and not sh.done
            }
            if not mine or link.remote is None:
                continue
            rids = {self._pulls.get(tid).request_id: tid for tid in mine}
            sent = time.monotonic()
            try:
                resp = await self.p.peers.heartbeat(
                    link,
                    list(rids),
                    int(self.p.limits.heartbeat_timeout_s * 1000),
                    max(interval, 1e-3),
                )
            except KvxferdError as err:
                log.info("heartbeat failed", extra=kv(peer=link.address, error=str(err)))
                continue
            lost = set(resp.lost_request_ids)
            if resp.instance_id != link.remote.instance_id:
                lost = set(rids)
                await self.p.peers.invalidate(
                    link.address, f"peer restarted (instance {resp.instance_id})", LinkState.STALE
                )
            for rid, tid in rids.items():
                share = mine[tid]
                if rid in lost:
                    share.lost = True
                    await self._abort(tid, "the owner no longer holds our share of the lease")
                elif resp.renewed_ms:
                    share.valid_until = max(share.valid_until, sent + resp.renewed_ms / 1000)

    def stop(self) -> None:
        for hb in self._heartbeats.values():
            hb.cancel()
