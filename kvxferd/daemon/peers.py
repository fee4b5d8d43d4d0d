"""Peers this daemon reads from: handshake client, cached per address and generation.

A :class:`PeerLink` is made once per peer address and reused for every pull; the handshake
(gRPC ``Peer.Handshake``) runs once per peer incarnation and registration generation, and
everything per peer (NIXL metadata, region table, spec, TP) is loaded then, never per request.
A refused or failed handshake is a typed error on the pull that needed it.

NIXL peers are keyed by identity, not by address: the agent name and the instance ID learned
in the handshake. Two addresses of one instance share its loaded metadata (the second
handshake loads nothing and cancels nothing); a different instance claiming a loaded agent
name is refused while the loaded instance still answers heartbeats at its own address, and
replaces it (cancelling the dead instance's pulls) once it does not. The directory is bounded
(``max_links``): links with no pull in flight are evicted, unreachable ones first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

from kvxferd.daemon.handshake import RemoteDescription, SelfDescription, decode_envelope
from kvxferd.daemon.links import LinkState, PeerLink
from kvxferd.errors import (
    DeadlineExceeded,
    IncompatiblePeer,
    KvxferdError,
    Mismatch,
    PeerUnavailable,
    PermissionDenied,
    ResourceExhausted,
)
from kvxferd.ipc.cma import OwnerProcess
from kvxferd.ipc.transport import TransportReport
from kvxferd.logs import kv
from kvxferd.peers import compat_digest
from kvxferd.v1 import peer_pb2
from kvxferd.wire.local import LocalTransport
from kvxferd.wire.peer_client import PeerClient, Transport

log = logging.getLogger(__name__)

# Handshakes one ready() makes at most while this daemon's own pool keeps changing under them.
HANDSHAKE_TRIES = 3

__all__ = ["LinkState", "PeerDirectory", "PeerLink", "RemoteDescription"]
__all__ += ["SelfDescription", "decode_envelope"]


class PeerDirectory:
    """Peer links by address. ``connect`` loads a handshaken peer into the transfer engine."""

    def __init__(
        self,
        me: Callable[[], SelfDescription],
        connect: Callable[[RemoteDescription], None],
        *,
        transport_factory: Callable[[str], Transport],
        metadata: tuple[tuple[str, str], ...],
        timeout_s: float,
        on_handshake: Callable[[PeerLink], None] | None = None,
        allow: Callable[[str], bool] | None = None,
        max_links: int = 1024,
        probe: Callable[[PeerLink, RemoteDescription], Awaitable[TransportReport]] | None = None,
        forget: Callable[[str, str], None] | None = None,
        local: Callable[[str], Transport] | None = None,
    ) -> None:
        """``probe``: after each handshake, which transport serves READs from the peer
        (kvxferd.ipc.transport; never raises). ``forget(agent, why)``: the peer's incarnation
        is gone or no longer trusted (invalidated, replaced, evicted): drop what was kept for
        it (its CUDA IPC mappings). ``local(path)``: a transport to a peer's same-host Peer
        socket (kvxferd.wire.local); None keeps every call on gRPC."""
        self._local = local
        self._probe = probe
        self._forget = forget
        self._max_links = max_links
        self._on_handshake = on_handshake
        self._allow = allow
        self._me = me
        self._connect = connect
        self._transport_factory = transport_factory
        self._metadata = metadata
        self._timeout_s = timeout_s
        self._links: dict[str, PeerLink] = {}
        self._agents: dict[str, tuple[RemoteDescription, str]] = {}  # name -> (loaded, address)
        self._closing: set[asyncio.Future[None]] = set()

    def links(self) -> list[PeerLink]:
        return list(self._links.values())

    def _link(self, address: str) -> PeerLink:
        link = self._links.get(address)
        if link is None:
            self._make_room()
            client = PeerClient(
                address,
                self._transport_factory(address),
                credentials=self._metadata,
                max_timeout_s=self._timeout_s,
            )
            link = PeerLink(address, client)
            self._links[address] = link
        link.last_used = time.monotonic()
        return link

    def _make_room(self) -> None:
        """Keep at most ``max_links``: evict idle links, unreachable and refused ones first,
        then the least recently used."""
        if len(self._links) < self._max_links:
            return
        idle = [x for x in self._links.values() if x.active == 0 and not x.lock.locked()]
        idle.sort(key=lambda x: (x.state is LinkState.READY, x.last_used))
        for link in idle[: len(self._links) - self._max_links + 1]:
            self._drop(link)
        if len(self._links) >= self._max_links:
            raise ResourceExhausted(
                f"{len(self._links)} peer links are in use (peers.max_links)",
                field="peer_address",
                fix="raise peers.max_links, or wait for pulls to finish",
            )

    def _drop(self, link: PeerLink) -> None:
        self._links.pop(link.address, None)
        self._forget_remote(link, "its link was evicted")
        self._closing.add(asyncio.ensure_future(link.client.close()))
        self._closing = {t for t in self._closing if not t.done()}
        log.info("peer link evicted", extra=kv(peer=link.address, state=link.state.value))

    def loaded(self, agent_name: str) -> RemoteDescription | None:
        """The description whose NIXL metadata the transfer engine holds for ``agent_name``
        now (a READ to that agent goes to this instance), or None."""
        known = self._agents.get(agent_name)
        return known[0] if known is not None else None

    def usable(self, address: str) -> PeerLink | None:
        """The peer at ``address`` if usable now (a link exists only for an allowed address),
        else None: then await :meth:`ready`. A pull's usual case, without a coroutine or timer."""
        link = self._links.get(address)
        if link is None or not link.usable:
            return None
        link.last_used = time.monotonic()
        return link

    async def ready(self, address: str) -> PeerLink:
        """The peer at ``address``, handshaking first if it has not been (or was lost)."""
        if self._allow is not None and not self._allow(address):
            raise PermissionDenied(
                f"peer address {address!r} is not in this daemon's peers.allow list",
                field="peer_address",
                fix="add the address (or its CIDR) to peers.allow, or pull from an allowed peer",
            )
        link = self._link(address)
        if link.usable:
            return link
        async with link.lock:
            for _ in range(HANDSHAKE_TRIES):  # again while our own pool changes under it
                if link.usable:
                    break
                try:
                    await self._handshake(link)
                finally:
                    if self._on_handshake is not None:
                        self._on_handshake(link)
            return link

    async def refresh(self, link: PeerLink, generation: int) -> None:
        """Handshake again if the peer's registration generation is no longer the one this
        link handshook with (its engine re-attached, so its regions and metadata changed).
        The peer's KV layout must not have changed: the pull was planned against it."""
        old = link.remote
        if old is None or not generation or old.generation == generation:
            return
        async with link.lock:
            if link.remote is not None and link.remote.generation == generation:
                return
            log.info(
                "peer re-registered; handshaking again",
                extra=kv(peer=link.address, was=old.generation, now=generation),
            )
            try:
                await self._handshake(link)
            finally:
                if self._on_handshake is not None:
                    self._on_handshake(link)
        new = link.remote
        assert new is not None
        if compat_digest(new.info.spec) != compat_digest(old.info.spec):
            raise PeerUnavailable(
                f"peer {link.address} re-attached a KV pool with a different layout"
                f" ({new.info.spec.describe()}) than this pull was planned for",
                field="peer_address",
                fix="start the pull again: it is planned against the new layout",
            )

    async def invalidate(
        self, address: str, reason: str, state: LinkState = LinkState.UNREACHABLE
    ) -> None:
        """Forget the handshake (peer restarted or died); the next pull handshakes again."""
        link = self._links.get(address)
        if link is not None and link.state is not LinkState.HANDSHAKING:
            link.state = state
            link.last_error = reason
            self._forget_remote(link, reason)

    def stale_all(self, reason: str) -> None:
        """This daemon's own pool changed (an engine attached or detached): every handshake
        was checked against the old one, so each link handshakes again at its next pull."""
        for address in list(self._links):
            link = self._links[address]
            if link.state is LinkState.HANDSHAKING:
                link.stale_during = reason  # it describes the old pool: it ends STALE
            elif link.remote is not None:
                link.state, link.last_error = LinkState.STALE, reason
                self._forget_remote(link, reason)

    def _forget_remote(self, link: PeerLink, why: str) -> None:
        _drop_owner(link, why)
        if self._forget is not None and link.remote is not None:
            self._forget(link.remote.agent_name, why)

    async def heartbeat(
        self, link: PeerLink, renew: list[str], renew_ms: int, timeout_s: float
    ) -> peer_pb2.HeartbeatResponse:
        """One Heartbeat on ``link`` (renewing this reader's shares of ``renew``)."""
        me = self._me()
        return await link.client.heartbeat(
            peer_pb2.HeartbeatRequest(
                daemon_id=me.daemon_id,
                instance_id=me.instance_id,
                registration_generation=me.generation,
                renew_request_ids=renew,
                renew_ms=renew_ms,
            ),
            timeout_s,
        )

    async def _alive(self, address: str, instance_id: str) -> bool:
        """Does the instance loaded from ``address`` still answer there as itself?"""
        link = self._links.get(address)
        if link is None or not link.client.session:
            return False
        try:
            resp = await self.heartbeat(link, [], 0, min(self._timeout_s, 2.0))
        except KvxferdError:
            return False
        return resp.instance_id == instance_id

    async def _load(self, link: PeerLink, remote: RemoteDescription) -> None:
        """Load ``remote`` into the transfer engine, keyed by its identity (see the module doc)."""
        known = self._agents.get(remote.agent_name)
        if known is not None:
            loaded, where = known
            if loaded.instance_id == remote.instance_id:
                if loaded.agent_metadata == remote.agent_metadata:
                    return  # the same instance again (another address, or a re-handshake)
            elif where != link.address and await self._alive(where, loaded.instance_id):
                raise IncompatiblePeer(
                    [
                        Mismatch(
                            "NIXL agent name",
                            f"{remote.agent_name!r} loaded from instance {loaded.instance_id}"
                            f" at {where}, which is alive",
                            f"instance {remote.instance_id} at {link.address}",
                            "every daemon needs its own nixl.agent_name",
                        )
                    ],
                    peer=link.address,
                )
            for other in self._links.values():
                same = other.remote is not None and other.remote.agent_name == remote.agent_name
                if other is not link and same:
                    other.state = LinkState.STALE
                    other.last_error = f"instance {remote.instance_id} replaced it"
                    _drop_owner(other, other.last_error)
            if self._forget is not None:
                self._forget(remote.agent_name, f"instance {remote.instance_id} replaced it")
        self._connect(remote)
        self._agents[remote.agent_name] = (remote, link.address)

    async def _handshake(self, link: PeerLink) -> None:
        me = self._me()
        version, digest, payload = me.envelope()
        link.state, link.stale_during = LinkState.HANDSHAKING, ""
        _drop_owner(link, "the peer is being handshaken again")
        try:
            resp = await link.client.handshake(version, digest, payload)
            remote = decode_envelope(
                resp.protocol_version, resp.compat_digest, resp.payload, me, link.address
            )
            if (
                not link.client.session
                or link.remote is None
                or link.remote.instance_id != remote.instance_id
            ):
                # A new peer instance: a new session. The same instance (its engine
                # re-attached) still knows the old one, under which our shares were confirmed.
                link.client.session = resp.session.hex()
            await self._load(link, remote)
        except (PeerUnavailable, DeadlineExceeded) as err:
            link.state = LinkState.UNREACHABLE
            link.last_error = str(err)
            log.warning("handshake failed", extra=kv(peer=link.address, error=str(err)))
            raise
        except KvxferdError as err:
            link.state = LinkState.REFUSED
            link.last_error = str(err)
            log.warning("handshake refused", extra=kv(peer=link.address, error=str(err)))
            raise
        except asyncio.CancelledError:  # no longer in progress: the next pull handshakes anew
            link.state = LinkState.UNREACHABLE
            link.last_error = (
                "the handshake did not finish: the pull that started it gave up (its deadline,"
                " or its caller) before the peer answered"
            )
            raise
        channel = await self._use_local(link, remote)
        if self._probe is not None:
            link.transport = await self._probe(link, remote)
        link.remote = remote
        if link.stale_during:  # our pool changed meanwhile: the peer knows the old one
            link.state, link.last_error = LinkState.STALE, link.stale_during
            self._forget_remote(link, link.stale_during)
            return
        link.state = LinkState.READY
        link.last_error = ""
        link.last_handshake_ns = time.time_ns()
        t = link.transport
        log.info(
            "handshake done",
            extra=kv(
                peer=link.address,
                agent=remote.agent_name,
                generation=remote.generation,
                regions=int(remote.regions.shape[0]),
                read_transport=t.name if t else "",
                read_gbps=round(t.read_gbps, 3) if t and t.read_gbps == t.read_gbps else None,
                transport_detail=t.detail if t else "",
                same_host=bool(remote.host_id) and remote.host_id == me.host_id,
                peer_calls=channel,
                owner_pid=link.owner.pid if link.owner is not None else None,
            ),
        )

    async def _use_local(self, link: PeerLink, remote: RemoteDescription) -> str:
        """Send the pull-lifetime Peer calls through the peer's same-host socket once a
        Heartbeat through it reached this very instance; else keep them on gRPC. Returns
        which channel they take."""
        path = remote.local_socket
        if self._local is None or not path or not os.path.exists(path):  # another host
            await link.client.use_local(None)
            return "grpc"
        await link.client.use_local(self._local(path))
        try:
            # The whole handshake timeout: the peer has just answered the handshake, so a slow
            # answer here is a loaded host, not a dead peer (a stale socket fails to connect at
            # once), and giving up would keep this link off the socket and CMA until the next
            # handshake (a 1 s cap did, on a loaded 2-core machine).
            resp = await self.heartbeat(link, [], 0, self._timeout_s)
            if link.client.local is None:  # it could not connect: the call went over gRPC
                why = f"cannot connect to {path}"
            elif resp.instance_id == remote.instance_id:
                link.owner = _owner_process(link.client.local, remote)
                return f"unix:{path}"
            else:
                why = f"it answered as instance {resp.instance_id}"
        except KvxferdError as err:
            why = str(err)
        await link.client.use_local(None)
        log.info("peer socket not usable, using gRPC", extra=kv(peer=link.address, why=why))
        return "grpc"

    async def close(self) -> None:
        for link in self._links.values():
            _drop_owner(link, "this daemon is stopping")
            await link.client.close()
        self._links.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)


def _owner_process(channel: Transport | None, remote: RemoteDescription) -> OwnerProcess | None:
    """The process at the other end of the same-host socket that just answered as ``remote``'s
    instance (``SO_PEERCRED`` of that connection), tied to that connection and incarnation."""
    raw = getattr(channel, "inner", channel)  # the metered wrapper's socket transport
    if not isinstance(raw, LocalTransport) or raw.peer is None:
        return None
    pid, uid, _ = raw.peer
    return OwnerProcess.open(
        pid, uid, remote.key, connection=raw.connection, channel=channel, transport=raw
    )


def _drop_owner(link: PeerLink, why: str) -> None:
    """The link no longer vouches for the peer's process: CMA never reads that pid again."""
    if link.owner is not None:
        link.owner.drop(why)
        link.owner = None
