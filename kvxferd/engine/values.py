"""What the Engine service answers, as values an engine author reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvxferd.v1 import engine_pb2


@dataclass(frozen=True)
class HoldTicket:
    """What the scheduler passes to the decode side's StartPull (same field names)."""

    peer_address: str
    request_id: str
    remote_block_ids: tuple[tuple[int, ...], ...]
    expires_unix_ns: int

    def to_json(self) -> dict[str, Any]:
        return {
            "peer_address": self.peer_address,
            "request_id": self.request_id,
            "remote_block_ids": [list(g) for g in self.remote_block_ids],
            "expires_unix_ns": self.expires_unix_ns,
        }


@dataclass(frozen=True)
class ReleaseEvent:
    """A held request's blocks may be reused. ``reason``: DONE, EXPIRED, CANCELLED or
    ENGINE_DETACHED."""

    request_id: str
    reason: str
    block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class PoolState:
    """Describe's answer, in short."""

    state: str  # DETACHED, REGISTERING or REGISTERED
    mode: str  # OWNED, IMPORTED or "" when detached
    generation: int
    attachment_id: str
    held_requests: int
    peer_address: str
    scheduler_socket: str = ""  # the daemon's server.scheduler_socket, "" when it serves none


def pool_state(p: engine_pb2.PoolInfo) -> PoolState:
    return PoolState(
        state=engine_pb2.RegistrationState.Name(p.state).removeprefix("REGISTRATION_STATE_"),
        mode=""
        if p.state != engine_pb2.REGISTRATION_STATE_REGISTERED
        else engine_pb2.MemoryMode.Name(p.memory_mode).removeprefix("MEMORY_MODE_"),
        generation=p.registration_generation,
        attachment_id=p.attachment_id,
        held_requests=p.held_requests,
        peer_address=p.peer_address,
        scheduler_socket=p.scheduler_socket,
    )


__all__ = ["HoldTicket", "PoolState", "ReleaseEvent", "pool_state"]
