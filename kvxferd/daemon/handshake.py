"""The handshake's two descriptions: what this daemon says about itself, what a peer said.

:class:`SelfDescription` builds the payload and envelope this daemon sends (and answers with);
:func:`decode_envelope` checks a peer's envelope (protocol version, compatibility digest,
registrations, staging ring) and returns its :class:`RemoteDescription`, or raises the typed
refusal. Both sides of ``Peer.Handshake`` use them: the reader's directory
(:mod:`kvxferd.daemon.peers`) and the Peer servicer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxferd.errors import (
    IncompatiblePeer,
    InvalidRequest,
    Mismatch,
)
from kvxferd.ipc.publish import IpcPool
from kvxferd.logs import kv
from kvxferd.peers import PeerInfo, compat_digest, require_compatible
from kvxferd.peers.version import PROTOCOL_VERSION
from kvxferd.staging.chunks import RingInfo
from kvxferd.staging.facts import PairFacts
from kvxferd.v1 import peer_pb2, spec_pb2
from kvxferd.wire.codec import mode_from_proto, mode_to_proto, spec_from_proto, spec_to_proto

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SelfDescription:
    """What this daemon says about itself in a handshake."""

    info: PeerInfo
    agent_name: str
    agent_metadata: bytes
    registrations: tuple[spec_pb2.RegionRegistration, ...]
    generation: int
    daemon_id: str
    instance_id: str
    address: str
    staging: RingInfo | None = None
    host_id: str = ""  # kvxferd.ipc.host.host_id(): who can open our CUDA IPC handles
    ipc: IpcPool | None = None  # our VRAM regions over CUDA IPC (KERNEL pulls)
    local_socket: str = ""  # our same-host Peer socket (kvxferd.service.local_peer)

    def payload(self) -> peer_pb2.HandshakePayload:
        ring = self.staging
        return peer_pb2.HandshakePayload(
            host_id=self.host_id,
            cuda_ipc=self.ipc.to_proto() if self.ipc is not None else None,
            staging=peer_pb2.StagingRing(
                base_address=ring.base,
                chunk_bytes=ring.chunk_bytes,
                chunks=ring.chunks,
                device_id=ring.device,
                stream=ring.stream,
            )
            if ring
            else None,
            spec=spec_to_proto(self.info.spec),
            registrations=list(self.registrations),
            nixl_agent_name=self.agent_name,
            nixl_agent_metadata=self.agent_metadata,
            registration_generation=self.generation,
            tp_rank=self.info.tp_rank,
            tp_size=self.info.tp_size,
            prefix_caching=self.info.prefix_caching,
            daemon_id=self.daemon_id,
            instance_id=self.instance_id,
            peer_address=self.address,
            transfer_mode=mode_to_proto(self.info.transfer_mode),
            local_socket=self.local_socket,
            kernel_only_reason=self.ipc.kernel_only if self.ipc is not None else "",
        )

    def envelope(self) -> tuple[int, bytes, bytes]:
        digest = bytes.fromhex(compat_digest(self.info.spec))
        return PROTOCOL_VERSION, digest, self.payload().SerializeToString()


@dataclass(frozen=True)
class RemoteDescription:
    """A peer as its handshake payload described it."""

    info: PeerInfo
    agent_name: str
    agent_metadata: bytes
    regions: np.ndarray[Any, np.dtype[np.int64]]  # N x 3 (addr, len, dev)
    generation: int
    daemon_id: str
    instance_id: str
    address: str
    staging: RingInfo | None = None
    host_id: str = ""
    ipc: IpcPool | None = None
    local_socket: str = ""
    kernel_only: str = ""  # why its pool is read with KERNEL only (not registered with NIXL)
    # What decide() derives from this generation and our pool, computed on its first pull.
    facts: PairFacts = field(default_factory=PairFacts, compare=False, repr=False)

    @property
    def key(self) -> tuple[str, str, int]:
        """This incarnation: (agent name, instance ID, registration generation)."""
        return self.agent_name, self.instance_id, self.generation


def _ring(msg: peer_pb2.HandshakePayload) -> RingInfo | None:
    """The advertised staging ring; None when absent or unusable (the peer is read DIRECT)."""
    if not msg.HasField("staging"):
        return None
    r = msg.staging
    if r.chunks < 1 or r.chunk_bytes == 0 or r.base_address == 0:
        log.warning("ignoring a malformed staging ring", extra=kv(ring=str(r).replace("\n", " ")))
        return None
    return RingInfo(r.base_address, r.chunk_bytes, r.chunks, r.device_id, stream=r.stream)


def decode_envelope(
    version: int, digest: bytes, payload: bytes, local: SelfDescription, who: str
) -> RemoteDescription:
    """Check the version before decoding anything else, then decode and check compatibility.

    The digest is compared first as a fast path; a differing digest still decodes the payload
    so that the refusal can list every mismatch.
    """
    if version != PROTOCOL_VERSION:
        raise IncompatiblePeer(
            [
                Mismatch(
                    "protocol version",
                    str(PROTOCOL_VERSION),
                    str(version),
                    "run the same kvxferd protocol version on both sides (upgrade the older)",
                )
            ],
            peer=who,
        )
    if not payload:
        raise IncompatiblePeer(
            [Mismatch("handshake payload", "a HandshakePayload", "empty", "check the peer build")],
            peer=who,
        )
    msg = peer_pb2.HandshakePayload()
    try:
        msg.ParseFromString(payload)
    except Exception as exc:  # protobuf raises DecodeError (a bare Exception subclass)
        raise IncompatiblePeer(
            [Mismatch("handshake payload", "kvxferd.v1", "undecodable", "check the peer build")],
            peer=who,
        ) from exc
    _check_registrations(msg)
    remote = RemoteDescription(
        info=PeerInfo(
            spec=spec_from_proto(msg.spec, "payload.spec"),
            tp_rank=msg.tp_rank,
            tp_size=msg.tp_size,
            prefix_caching=msg.prefix_caching,
            protocol_version=version,
            name=who,
            transfer_mode=mode_from_proto(msg.transfer_mode),
        ),
        agent_name=msg.nixl_agent_name,
        agent_metadata=msg.nixl_agent_metadata,
        regions=np.array(
            [(r.base_address, r.nbytes, r.device_id) for r in msg.registrations], dtype=np.int64
        ).reshape(-1, 3),
        generation=msg.registration_generation,
        daemon_id=msg.daemon_id,
        instance_id=msg.instance_id,
        address=msg.peer_address,
        staging=_ring(msg),
        host_id=msg.host_id,
        ipc=IpcPool.from_proto(msg.cuda_ipc) if msg.HasField("cuda_ipc") else None,
        local_socket=msg.local_socket,
        kernel_only=msg.kernel_only_reason,
    )
    if digest == bytes.fromhex(compat_digest(local.info.spec)):
        log.debug("handshake digest matches", extra=kv(peer=who))
    require_compatible(local.info, remote.info)
    names = [r.name for r in remote.info.spec.regions]
    if len(names) != remote.regions.shape[0]:
        raise IncompatiblePeer(
            [
                Mismatch(
                    "registered regions",
                    str(len(local.info.spec.regions)),
                    f"{remote.regions.shape[0]} registrations for {len(names)} regions",
                    "the peer must register every region of its spec",
                )
            ],
            peer=who,
        )
    return remote


_INT64_MAX = (1 << 63) - 1


def _check_registrations(msg: peer_pb2.HandshakePayload) -> None:
    """Addresses and sizes are uint64 on the wire but int64 in the region tables: refuse what
    does not fit instead of failing inside numpy."""
    for i, r in enumerate(msg.registrations):
        for name in ("base_address", "nbytes"):
            if getattr(r, name) > _INT64_MAX:
                raise InvalidRequest(
                    f"registrations[{i}].{name} = {getattr(r, name)} is not below 2^63",
                    field=f"payload.registrations[{i}].{name}",
                    fix="send the region's real address and size",
                )
    ring = msg.staging
    if max(ring.base_address, ring.chunk_bytes) > _INT64_MAX:
        raise InvalidRequest(
            "the staging ring's address or size is not below 2^63",
            field="payload.staging",
            fix="send the ring's real address and size",
        )
