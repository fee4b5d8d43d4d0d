"""The owner role (prefill side): holds, leases, peer sessions, releases to the engine.

An engine holds a request's blocks (:meth:`Owner.hold`); readers confirm, extend, release and
heartbeat their own share under the session their handshake opened
(:mod:`kvxferd.daemon.sessions`), never under a name they put in a request; every lease end
reaches the engine's release watchers once. Pure asyncio on the service loop; the lease table
(:mod:`kvxferd.transfer.leases`) is the authority.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxferd.blocks import check_block_ids, expand_group
from kvxferd.daemon.backlog import Backlog
from kvxferd.daemon.parts import Parts
from kvxferd.daemon.peers import RemoteDescription
from kvxferd.daemon.sessions import PeerSession, Sessions
from kvxferd.errors import InvalidRequest, LeaseRefused, NotFound, UnknownSession
from kvxferd.logs import kv
from kvxferd.transfer import ReleaseFeed, ReleaseReason, notify
from kvxferd.transfer.leases import Lease, LeaseView

log = logging.getLogger(__name__)

_RELEASES_FIX = (
    "read the stream as fast as releases come; open it again to go on (the releases it"
    " dropped are not sent again: Describe's held_requests counts what is still held)"
)

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Release:
    """A held request the engine may now free: the logical IDs it held, and why."""

    request_id: str
    reason: ReleaseReason
    logical_ids: tuple[Int64Array, ...]


@dataclass(frozen=True)
class HeldRequest:
    request_id: str
    logical_ids: tuple[Int64Array, ...]
    lease: Lease


class Owner:
    """The owner side of one daemon."""

    def __init__(self, parts: Parts) -> None:
        self.p = parts
        self.sessions = Sessions(
            liveness_s=parts.limits.heartbeat_timeout_s,
            reading=parts.leases.reading,
            on_retire=self._retire_session,
        )
        self._held: dict[str, HeldRequest] = {}
        self._described: dict[str, RemoteDescription] = {}  # session token -> its handshake
        self._release_watchers: list[tuple[frozenset[str], Backlog[Release]]] = []
        parts.leases.due.on_read_done = parts.metrics.lease_read_seconds.observe

    async def start_release_pump(self) -> None:
        """Forward lease releases (from any thread) to engine watchers on this loop."""
        feed = ReleaseFeed(asyncio.get_running_loop())
        self.p.leases.subscribe(feed)
        self.p.spawn(self._pump_releases(feed))

    async def _pump_releases(self, feed: ReleaseFeed) -> None:
        async for rel in feed:
            held = self._held.pop(rel.request_id, None)
            if held is None:
                continue  # not held through this daemon (cannot happen; be safe)
            release = Release(rel.request_id, rel.reason, held.logical_ids)
            m = self.p.metrics
            m.child(m.lease_releases, rel.reason.value).inc()
            # Read as asked: the hold was this request's INFO line. Anything else stands out.
            log.log(
                logging.DEBUG if rel.reason is ReleaseReason.DONE else logging.INFO,
                "lease released",
                extra=kv(request_id=rel.request_id, reason=rel.reason.value, readers=rel.readers),
            )
            for ids, q in self._release_watchers:
                if not ids or rel.request_id in ids:
                    q.put(release)

    def hold(
        self,
        request_id: str,
        logical_ids: Sequence[Sequence[int] | Int64Array],
        readers: int,
        ttl_s: float | None,
    ) -> HeldRequest:
        notify.check_request_id(request_id)  # every reader's notification must carry it
        spec = self.p.pool.spec
        if len(logical_ids) != len(spec.groups):
            raise InvalidRequest(
                f"{len(logical_ids)} block-ID lists for {len(spec.groups)} KV cache groups",
                field="block_ids.groups",
                fix=f"send one list per group, in order: {[g.name for g in spec.groups]}",
            )
        checked: list[Int64Array] = []
        kernel: list[Int64Array] = []
        for g, ids in enumerate(logical_ids):
            group = spec.groups[g]
            limit = spec.num_kernel_blocks(g) if group.kind.is_state else spec.num_logical_blocks(g)
            arr = check_block_ids(
                ids, limit, f"block_ids.groups[{g}].ids", max_ids=self.p.limits.max_block_ids
            )
            checked.append(arr)
            kernel.append(expand_group(group, arr))
        lease = self.p.leases.hold(
            request_id, kernel, readers=max(1, readers), ttl_s=ttl_s or self.p.limits.lease_ttl_s
        )
        held = HeldRequest(request_id, tuple(checked), lease)
        self._held[request_id] = held
        log.info(
            "request held",
            extra=kv(request_id=request_id, blocks=[int(a.size) for a in checked], readers=readers),
        )
        return held

    def held(self, request_id: str) -> HeldRequest:
        h = self._held.get(request_id)
        if h is None or request_id not in self.p.leases:
            reason = self.p.leases.ended(request_id)
            if reason is None:
                raise NotFound(
                    f"request {request_id!r} is not held here (never held, or released long ago)",
                    field="request_id",
                    fix="the prefill engine must Hold the request before the decode side pulls it",
                )
            raise LeaseRefused(
                f"request {request_id!r} is no longer held ({reason.value}); its blocks may be"
                " reused",
                field="request_id",
                fix="do not read: re-run the prefill (or hold with a longer TTL)",
            )
        return h

    # Every reader call below names the caller by its handshake session (kvxferd.daemon.sessions),
    # never by a field of the request.

    def accept_handshake(self, remote: RemoteDescription, who: str) -> PeerSession:
        """A peer handshook: give it a session. Its NIXL metadata is not loaded here: an owner
        only answers READs and receives notifications, and a reader loads what it reads from
        when it handshakes itself (so a handshake never disturbs this daemon's own pulls). The
        description is kept with the session: in push mode the owner loads it at the first
        Push (:mod:`kvxferd.daemon.pusher`)."""
        session = self.sessions.open(
            remote.agent_name, remote.instance_id, remote.daemon_id, remote.address or who
        )
        self._described[session.token] = remote  # push mode writes into what it registered
        # A reader that handshakes again with this same instance (its own engine re-attached:
        # new generation, same instance ID) keeps calling under the session of its first
        # handshake, under which its shares were confirmed (PeerDirectory._handshake). One
        # instance has one pool at a time, and its generation only grows: every session of it
        # now describes the newest registrations, or a Push would WRITE into dropped memory.
        for token, known in self._described.items():
            if (
                known.agent_name == remote.agent_name
                and known.instance_id == remote.instance_id
                and known.generation < remote.generation
            ):
                self._described[token] = remote
        return session

    def described(self, session: PeerSession) -> RemoteDescription:
        """What the caller's handshake said about it (push mode: where to write)."""
        remote = self._described.get(session.token)
        if remote is None:
            raise UnknownSession(
                "this peer session has no handshake description here",
                fix="handshake again and send the returned session as kvxferd-session metadata",
            )
        return remote

    def share_s(self, requested_s: float) -> float:
        return self._share_s(requested_s)

    def _share_s(self, requested_s: float) -> float:
        """A reader's share lasts what it asked, capped by the heartbeat timeout (heartbeats
        renew it), so a reader that dies frees its blocks within that timeout."""
        cap = self.p.limits.heartbeat_timeout_s
        return cap if requested_s <= 0 else min(requested_s, cap)

    def confirm_lease(
        self, session: PeerSession, request_id: str, extend_s: float
    ) -> tuple[HeldRequest, LeaseView]:
        self.p.slot.current()  # EngineDetached: say why, rather than "not held"
        view = self.p.leases.confirm(request_id, session.reader, self._share_s(extend_s))
        return self.held(request_id), view

    def extend_lease(
        self, session: PeerSession, request_id: str, extend_s: float
    ) -> tuple[HeldRequest, LeaseView]:
        if extend_s <= 0:
            raise InvalidRequest(
                "extend_ms must be > 0", field="extend_ms", fix="send how long to extend, in ms"
            )
        view = self.p.leases.extend(request_id, session.reader, self._share_s(extend_s))
        return self.held(request_id), view

    def release_lease(
        self, session: PeerSession, request_id: str, *, done: bool
    ) -> tuple[HeldRequest, LeaseView, bool]:
        held = self.held(request_id)
        view, released = self.p.leases.finish(request_id, session.reader, done=done)
        return held, view, released

    def decline_lease(
        self, session: PeerSession, request_id: str
    ) -> tuple[HeldRequest | None, LeaseView, bool]:
        """The caller gives up its place in the lease without reading (DeclineLease). A lease
        released before is answered as released, not refused (nothing is held for the caller:
        the decline's goal is met); the held request is None once its release reached the
        engine. NotFound when never held (or forgotten)."""
        view, released = self.p.leases.decline(request_id, session.reader)
        held = self._held.get(request_id)
        log.info(
            "reader declined a held request",
            extra=kv(request_id=request_id, reader=session.agent_name, released=released),
        )
        return held, view, released

    def heartbeat(
        self, session: PeerSession, request_ids: Sequence[str], renew_s: float
    ) -> tuple[list[str], float]:
        """Renew the caller's shares; returns the lost request IDs and how long each renewed
        share now lasts (renew_ms is clamped to the heartbeat timeout, never refused)."""
        granted = self._share_s(renew_s) if renew_s > 0 else 0.0
        return self.p.leases.renew(session.reader, request_ids, granted), granted

    def _retire_session(self, session: PeerSession) -> None:
        """A reader restarted or was evicted: its shares lapse now, its staging slots return."""
        self._described.pop(session.token, None)
        n = self.p.leases.reader_gone(session.reader)
        owner = self.p.staging.owner if self.p.staging else None
        if owner is not None:
            owner.release_reader(session.reader)
        if n:
            log.warning(
                "reader replaced while reading; its shares lapsed",
                extra=kv(agent=session.agent_name, instance=session.instance_id, shares=n),
            )

    def held_request_ids(self) -> list[str]:
        return list(self._held)

    def watch_releases(
        self, request_ids: frozenset[str], *, bounded: bool = True
    ) -> Backlog[Release]:
        """Every later release of ``request_ids`` (all when empty); ``bounded``: at most
        ``server.watch_backlog`` unread (a WatchReleases stream). An engine's own Session is
        not bounded: it holds what it reads."""
        limit = self.p.limits.watch_backlog if bounded else None
        q: Backlog[Release] = Backlog(limit, "WatchReleases stream", _RELEASES_FIX)
        self._release_watchers.append((request_ids, q))
        return q

    def unwatch_releases(self, q: Backlog[Release]) -> None:
        self._release_watchers = [(i, w) for i, w in self._release_watchers if w is not q]
