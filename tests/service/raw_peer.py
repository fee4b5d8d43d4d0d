"""A raw Peer-service caller for tests: handshakes as a (possibly hostile) peer daemon.

It sends a valid handshake for a preset (with NIXL metadata that is never loaded: an owner
does not load its callers' metadata) under the agent name and instance it is told, and keeps
the returned session, so a test can act as a second reader, a third party or an impostor.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpc import aio

from kvxferd.daemon.peers import SelfDescription
from kvxferd.daemon.sessions import SESSION_METADATA
from kvxferd.layout.presets import preset
from kvxferd.peers import PeerInfo
from kvxferd.v1 import common_pb2, peer_pb2, peer_pb2_grpc, spec_pb2


@dataclass
class RawPeer:
    stub: peer_pb2_grpc.PeerAsyncStub
    session: str = ""
    instance_id: str = ""

    @property
    def md(self) -> tuple[tuple[str, str], ...]:
        return ((SESSION_METADATA, self.session),)

    async def confirm(self, rid: str, extend_ms: int = 5_000) -> peer_pb2.ConfirmLeaseResponse:
        return await self.stub.ConfirmLease(
            peer_pb2.ConfirmLeaseRequest(request_id=rid, extend_ms=extend_ms),
            metadata=self.md,
            timeout=10,
        )

    async def release(self, rid: str, *, done: bool = False) -> peer_pb2.ReleaseLeaseResponse:
        reason = common_pb2.RELEASE_REASON_DONE if done else common_pb2.RELEASE_REASON_CANCELLED
        return await self.stub.ReleaseLease(
            peer_pb2.ReleaseLeaseRequest(request_id=rid, reader_id="anyone", reason=reason),
            metadata=self.md,
            timeout=10,
        )

    async def heartbeat(self, rids: list[str], renew_ms: int) -> peer_pb2.HeartbeatResponse:
        return await self.stub.Heartbeat(
            peer_pb2.HeartbeatRequest(renew_request_ids=rids, renew_ms=renew_ms),
            metadata=self.md,
            timeout=10,
        )


def describe(spec_text: str, agent: str, instance: str) -> SelfDescription:
    spec = preset(spec_text)
    regs = tuple(
        spec_pb2.RegionRegistration(
            region_name=r.name, base_address=4096 * (i + 1), device_id=0, nbytes=4096
        )
        for i, r in enumerate(spec.regions)
    )
    return SelfDescription(
        info=PeerInfo(spec=spec, tp_rank=0, tp_size=1, prefix_caching=False),
        agent_name=agent,
        agent_metadata=b"never-loaded",
        registrations=regs,
        generation=1,
        daemon_id=agent,
        instance_id=instance,
        address="127.0.0.1:1",
    )


async def handshake(
    address: str, spec_text: str, *, agent: str, instance: str = "raw-instance"
) -> RawPeer:
    stub = peer_pb2_grpc.PeerStub(aio.insecure_channel(address))
    version, digest, payload = describe(spec_text, agent, instance).envelope()
    resp = await stub.Handshake(
        peer_pb2.HandshakeRequest(protocol_version=version, compat_digest=digest, payload=payload),
        timeout=10,
    )
    return RawPeer(stub, resp.session.hex(), instance)
