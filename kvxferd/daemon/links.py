"""A peer link: one peer address as this daemon knows it (its client, handshake, state).

:class:`~kvxferd.daemon.peers.PeerDirectory` makes one per address and keeps it across pulls.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvxferd.daemon.handshake import RemoteDescription
from kvxferd.errors import DeadlineExceeded
from kvxferd.ipc.cma import OwnerProcess
from kvxferd.ipc.transport import TransportReport
from kvxferd.wire.peer_client import PeerClient

if TYPE_CHECKING:
    from kvxferd.daemon.peers import PeerDirectory


class LinkState(enum.Enum):
    NEW = "NEW"
    HANDSHAKING = "HANDSHAKING"
    READY = "READY"
    REFUSED = "REFUSED"
    UNREACHABLE = "UNREACHABLE"
    STALE = "STALE"  # the peer restarted or re-registered; the next pull handshakes again


@dataclass
class PeerLink:
    """One peer address: its client, its handshake result, its state."""

    address: str
    client: PeerClient
    state: LinkState = LinkState.NEW
    remote: RemoteDescription | None = None
    last_error: str = ""
    last_handshake_ns: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    active: int = 0  # pulls in flight through this link (the reader keeps it)
    last_used: float = 0.0
    transport: TransportReport | None = None  # what serves READs from it (probed at connect)
    owner: OwnerProcess | None = None  # the peer's process, named by the kernel (CMA pulls)
    # Why this daemon's own pool changed while a handshake was in flight: that handshake
    # described the old pool, so it does not make the link READY (PeerDirectory.stale_all).
    stale_during: str = ""

    @property
    def usable(self) -> bool:
        return self.state is LinkState.READY and self.remote is not None


async def handshaken(peers: PeerDirectory, address: str, deadline_s: float, what: str) -> PeerLink:
    """The peer at ``address`` once handshaken (for a caller whose ``peers.usable`` said
    not yet), within ``deadline_s``: else DeadlineExceeded, naming ``what`` ("pull")."""
    try:
        return await asyncio.wait_for(peers.ready(address), timeout=deadline_s)
    except TimeoutError:
        raise DeadlineExceeded(
            f"the handshake with {address} outlasted the {what}'s deadline ({deadline_s:g}s)",
            field="peer_address",
            fix="check that the peer daemon runs at that address, or raise deadline_ms",
        ) from None


__all__ = ["LinkState", "PeerLink", "handshaken"]
