"""What the Scheduler service answers, as typed values (enums and frozen dataclasses)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvxferd.v1 import common_pb2, scheduler_pb2


class TransferState(enum.Enum):
    UNSPECIFIED = 0
    PENDING = 1
    HANDSHAKING = 2
    CONFIRMING = 3
    TRANSFERRING = 4
    DONE = 5
    FAILED = 6
    CANCELLED = 7
    EXPIRED = 8

    @property
    def terminal(self) -> bool:
        return self in (
            TransferState.DONE,
            TransferState.FAILED,
            TransferState.CANCELLED,
            TransferState.EXPIRED,
        )

    @classmethod
    def of(cls, value: int) -> TransferState:
        try:
            return cls(value)
        except ValueError:
            return cls.UNSPECIFIED


class TransferStrategy(enum.Enum):
    UNSPECIFIED = 0
    DIRECT = 1
    STAGED = 2
    KERNEL = 3
    CMA = 4

    @classmethod
    def of(cls, value: int) -> TransferStrategy:
        try:
            return cls(value)
        except ValueError:
            return cls.UNSPECIFIED


class PeerState(enum.Enum):
    UNSPECIFIED = 0
    CONNECTING = 1
    READY = 2
    REFUSED = 3
    UNREACHABLE = 4
    STALE = 5

    @classmethod
    def of(cls, value: int) -> PeerState:
        try:
            return cls(value)
        except ValueError:
            return cls.UNSPECIFIED


class ChecksumAlgorithm(enum.Enum):
    UNSPECIFIED = 0
    BLAKE2B_64 = 1
    XXH64 = 2
    SHA256 = 3


@dataclass(frozen=True)
class Mismatch:
    what: str
    local: str
    remote: str
    fix: str


@dataclass(frozen=True)
class ErrorInfo:
    """The daemon's typed error (``common.proto`` ``ErrorDetail``)."""

    kind: str  # ErrorKind name without its prefix, e.g. "INCOMPATIBLE_PEER"
    message: str
    field: str = ""
    fix: str = ""
    mismatches: tuple[Mismatch, ...] = ()

    @classmethod
    def from_proto(cls, msg: common_pb2.ErrorDetail) -> ErrorInfo:
        try:
            kind = common_pb2.ErrorKind.Name(msg.kind).removeprefix("ERROR_KIND_")
        except ValueError:
            kind = str(msg.kind)
        return cls(
            kind=kind,
            message=msg.message,
            field=msg.field,
            fix=msg.fix,
            mismatches=tuple(Mismatch(m.what, m.local, m.remote, m.fix) for m in msg.mismatches),
        )

    def __str__(self) -> str:
        text = self.message
        if self.fix:
            text += f" (fix: {self.fix})"
        return text


def _groups(msg: common_pb2.GroupBlockIds) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(g.ids) for g in msg.groups)


@dataclass(frozen=True)
class TransferStatus:
    """One pull's status (``scheduler.proto`` ``TransferStatus``)."""

    transfer_id: str
    request_id: str
    peer_address: str
    state: TransferState
    nbytes: int
    strategy: TransferStrategy
    strategy_reason: str
    error: ErrorInfo | None
    invalid_local_block_ids: tuple[tuple[int, ...], ...]
    descriptors_before_coalescing: int
    descriptors_after_coalescing: int
    created_unix_ns: int
    started_unix_ns: int
    finished_unix_ns: int
    deadline_unix_ns: int
    revision: int
    stages: tuple[tuple[str, float], ...] = ()
    raw: scheduler_pb2.TransferStatus = field(
        default_factory=scheduler_pb2.TransferStatus, repr=False, compare=False
    )

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    @classmethod
    def from_proto(cls, msg: scheduler_pb2.TransferStatus) -> TransferStatus:
        return cls(
            transfer_id=msg.transfer_id,
            request_id=msg.request_id,
            peer_address=msg.peer_address,
            state=TransferState.of(msg.state),
            nbytes=msg.nbytes,
            strategy=TransferStrategy.of(msg.strategy),
            strategy_reason=msg.strategy_reason,
            error=ErrorInfo.from_proto(msg.error) if msg.HasField("error") else None,
            invalid_local_block_ids=_groups(msg.invalid_local_block_ids),
            descriptors_before_coalescing=msg.descriptors_before_coalescing,
            descriptors_after_coalescing=msg.descriptors_after_coalescing,
            created_unix_ns=msg.created_unix_ns,
            started_unix_ns=msg.started_unix_ns,
            finished_unix_ns=msg.finished_unix_ns,
            deadline_unix_ns=msg.deadline_unix_ns,
            revision=msg.revision,
            stages=tuple((s.name, s.seconds) for s in msg.stages),
            raw=msg,
        )


@dataclass(frozen=True)
class StartedPull:
    status: TransferStatus
    created: bool  # False: a pull with this transfer_id already existed (a retry)


@dataclass(frozen=True)
class Declined:
    """A peer's lease of a request after this daemon declined it (DeclinePull)."""

    # The peer freed the blocks: no other expected reader is left, or the peer had released
    # them already (its TTL passed, its other readers ended; then both counts are 0).
    released: bool
    readers_expected: int
    readers_confirmed: int  # readers that confirmed or declined, this daemon included

    @classmethod
    def from_proto(cls, msg: scheduler_pb2.DeclinePullResponse) -> Declined:
        return cls(msg.released, msg.readers_expected, msg.readers_confirmed)


@dataclass(frozen=True)
class PeerStatus:
    """A peer this daemon knows (``scheduler.proto`` ``PeerInfo``)."""

    address: str
    state: PeerState
    nixl_agent_name: str
    daemon_id: str
    instance_id: str
    registration_generation: int
    active_transfers: int
    last_error: ErrorInfo | None
    last_heartbeat_unix_ns: int
    last_handshake_unix_ns: int

    @classmethod
    def from_proto(cls, msg: scheduler_pb2.PeerInfo) -> PeerStatus:
        return cls(
            address=msg.address,
            state=PeerState.of(msg.handshake_state),
            nixl_agent_name=msg.nixl_agent_name,
            daemon_id=msg.daemon_id,
            instance_id=msg.instance_id,
            registration_generation=msg.registration_generation,
            active_transfers=msg.active_transfers,
            last_error=ErrorInfo.from_proto(msg.last_error) if msg.HasField("last_error") else None,
            last_heartbeat_unix_ns=msg.last_heartbeat_unix_ns,
            last_handshake_unix_ns=msg.last_handshake_unix_ns,
        )


__all__ = [
    "ChecksumAlgorithm",
    "ErrorInfo",
    "Mismatch",
    "PeerState",
    "PeerStatus",
    "StartedPull",
    "TransferState",
    "TransferStatus",
    "TransferStrategy",
]
