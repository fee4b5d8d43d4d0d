"""Owner side: who is calling. One session per accepted handshake, named by a random secret.

A peer that handshakes gets a session token (``HandshakeResponse.session``) and sends it as
``kvxferd-session`` metadata on every later Peer call. The session, never a field of a
request, is the reader for leases and staging slots: a third party that did not confirm a
lease cannot end another reader's share, whatever names it puts in its requests.

Sessions are keyed by token; each also records the NIXL agent name and instance ID the peer
handshook as. A handshake naming an agent whose sessions belong to another, live instance
(one that is reading and was heard from within the heartbeat timeout) is refused; a dead or
idle previous instance is retired, and its shares lapse at once (``on_retire``). Two
handshakes of one instance (the same peer reached under two addresses) get two sessions and
disturb nothing. The table is bounded: idle sessions are evicted oldest first.

Pure: injected clock, no gRPC. Runs on the service loop only.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvxferd.errors import IncompatiblePeer, Mismatch, UnknownSession
from kvxferd.logs import kv

log = logging.getLogger(__name__)

SESSION_METADATA = "kvxferd-session"


@dataclass
class PeerSession:
    token: str  # hex
    agent_name: str
    instance_id: str
    daemon_id: str
    address: str
    last_seen: float

    @property
    def reader(self) -> str:
        """The lease table's key for this reader."""
        return f"{self.agent_name}/{self.instance_id}/{self.token[:8]}"


class Sessions:
    """Sessions by token. ``reading(reader)`` tells how many shares a reader is reading."""

    def __init__(
        self,
        *,
        liveness_s: float,
        reading: Callable[[str], int],
        on_retire: Callable[[PeerSession], None],
        max_sessions: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._liveness_s = liveness_s
        self._reading = reading
        self._on_retire = on_retire
        self._max = max_sessions
        self._clock = clock
        self._by_token: OrderedDict[str, PeerSession] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_token)

    def open(self, agent_name: str, instance_id: str, daemon_id: str, address: str) -> PeerSession:
        now = self._clock()
        others = [
            s
            for s in self._by_token.values()
            if s.agent_name == agent_name and s.instance_id != instance_id
        ]
        live = [
            s for s in others if self._reading(s.reader) and now - s.last_seen < self._liveness_s
        ]
        if live:
            raise IncompatiblePeer(
                [
                    Mismatch(
                        "NIXL agent name",
                        f"{agent_name!r} in use by live instance {live[0].instance_id}",
                        f"instance {instance_id}",
                        "give every daemon its own nixl.agent_name; a restarted daemon is"
                        f" accepted once its old instance is silent for {self._liveness_s:g}s",
                    )
                ],
                peer=address,
            )
        for s in others:
            self._retire(s, f"replaced by instance {instance_id}")
        session = PeerSession(
            secrets.token_hex(16), agent_name, instance_id, daemon_id, address, now
        )
        self._by_token[session.token] = session
        self._evict(now)
        return session

    def get(self, token: str) -> PeerSession:
        """The caller's session (renewing its liveness), or :class:`UnknownSession`."""
        session = self._by_token.get(token) if token else None
        if session is None:
            raise UnknownSession(
                "this peer session is unknown here (this daemon restarted, or the caller never"
                " handshook)",
                field=SESSION_METADATA,
                fix="handshake again and send the returned session as kvxferd-session metadata",
            )
        session.last_seen = self._clock()
        self._by_token.move_to_end(token)
        return session

    def _evict(self, now: float) -> None:
        if len(self._by_token) <= self._max:
            return
        for s in list(self._by_token.values()):
            if len(self._by_token) <= self._max:
                break
            if not self._reading(s.reader) or now - s.last_seen >= self._liveness_s:
                self._retire(s, "session table full")

    def _retire(self, session: PeerSession, why: str) -> None:
        self._by_token.pop(session.token, None)
        log.info(
            "peer session retired",
            extra=kv(agent=session.agent_name, instance=session.instance_id, why=why),
        )
        self._on_retire(session)


__all__ = ["SESSION_METADATA", "PeerSession", "Sessions", "UnknownSession"]
