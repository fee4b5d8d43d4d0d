"""The Peer service: what a reader daemon asks of this (owner) daemon."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence

from kvxferd.daemon.core import Daemon
from kvxferd.daemon.owner import HeldRequest
from kvxferd.daemon.peers import decode_envelope
from kvxferd.daemon.sessions import SESSION_METADATA, PeerSession
from kvxferd.errors import InvalidRequest, KvxferdError, PermissionDenied
from kvxferd.logs import kv
from kvxferd.service.push import push
from kvxferd.service.rpc import Ctx, rpc
from kvxferd.service.staging import _owner, gather, release_staging
from kvxferd.staging.stage_owner import Announce, StageOpen, StageStream
from kvxferd.transfer.leases import LeaseView
from kvxferd.v1 import (
    common_pb2,
    peer_pb2,
    peer_pb2_grpc,
)
from kvxferd.wire.codec import group_ids_to_proto

log = logging.getLogger(__name__)


class PeerService(peer_pb2_grpc.PeerServicer):
    """Every call but Handshake acts for the caller's handshake session (its
    ``kvxferd-session`` metadata), never for a reader named in the request."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def _session(self, context: Ctx) -> PeerSession:
        token = ""
        for item in context.invocation_metadata() or ():
            key, value = item
            if key == SESSION_METADATA:
                token = value if isinstance(value, str) else ""
        return self.d.owner.sessions.get(token)

    async def Handshake(
        self, request: peer_pb2.HandshakeRequest, context: Ctx
    ) -> peer_pb2.HandshakeResponse:
        async def call() -> peer_pb2.HandshakeResponse:
            me = self.d.describe_self()
            who = context.peer() or "peer"
            try:
                remote = decode_envelope(
                    request.protocol_version, request.compat_digest, request.payload, me, who
                )
                session = self.d.owner.accept_handshake(remote, who)
            except KvxferdError:
                self.d.metrics.handshakes.labels("server", "refused").inc()
                raise
            self.d.metrics.handshakes.labels("server", "ok").inc()
            log.info(
                "handshake accepted",
                extra=kv(peer=who, agent=remote.agent_name, instance=remote.instance_id),
            )
            version, digest, payload = me.envelope()
            return peer_pb2.HandshakeResponse(
                protocol_version=version,
                compat_digest=digest,
                payload=payload,
                session=bytes.fromhex(session.token),
            )

        return await rpc(self.d, "Handshake", context, call)

    def _lease(
        self, held: HeldRequest | None, view: LeaseView, active: bool = True
    ) -> peer_pb2.Lease:
        """``held`` None: a request released before (DeclineLease), its block IDs forgotten."""
        remaining = max(0.0, view.expires_at - time.monotonic()) if active else 0.0
        return peer_pb2.Lease(
            request_id=view.request_id,
            state=peer_pb2.LEASE_STATE_ACTIVE if active else peer_pb2.LEASE_STATE_RELEASED,
            expires_unix_ns=time.time_ns() + int(remaining * 1e9),
            remaining_ms=int(remaining * 1000),
            block_ids=group_ids_to_proto(list(held.logical_ids) if held else []),
            readers_expected=view.readers,
            readers_confirmed=view.confirmations,
            readers_done=view.readers_done,
            registration_generation=self.d.generation,
        )

    async def ConfirmLease(
        self, request: peer_pb2.ConfirmLeaseRequest, context: Ctx
    ) -> peer_pb2.ConfirmLeaseResponse:
        async def call() -> peer_pb2.ConfirmLeaseResponse:
            session = self._session(context)
            held, view = self.d.owner.confirm_lease(
                session, request.request_id, request.extend_ms / 1000
            )
            return peer_pb2.ConfirmLeaseResponse(
                lease=self._lease(held, view), ticket=view.ticket, instance_id=self.d.instance_id
            )

        return await rpc(self.d, "ConfirmLease", context, call)

    async def ExtendLease(
        self, request: peer_pb2.ExtendLeaseRequest, context: Ctx
    ) -> peer_pb2.ExtendLeaseResponse:
        async def call() -> peer_pb2.ExtendLeaseResponse:
            session = self._session(context)
            held, view = self.d.owner.extend_lease(
                session, request.request_id, request.extend_ms / 1000
            )
            return peer_pb2.ExtendLeaseResponse(lease=self._lease(held, view))

        return await rpc(self.d, "ExtendLease", context, call)

    async def ReleaseLease(
        self, request: peer_pb2.ReleaseLeaseRequest, context: Ctx
    ) -> peer_pb2.ReleaseLeaseResponse:
        async def call() -> peer_pb2.ReleaseLeaseResponse:
            session = self._session(context)
            if request.reason not in (
                common_pb2.RELEASE_REASON_DONE,
                common_pb2.RELEASE_REASON_CANCELLED,
            ):
                raise InvalidRequest(
                    f"release reason {request.reason} is not DONE or CANCELLED",
                    field="reason",
                    fix="a reader releases its share as DONE (it read) or CANCELLED (gave up)",
                )
            held, view, released = self.d.owner.release_lease(
                session, request.request_id, done=request.reason == common_pb2.RELEASE_REASON_DONE
            )
            return peer_pb2.ReleaseLeaseResponse(lease=self._lease(held, view, active=not released))

        return await rpc(self.d, "ReleaseLease", context, call)

    async def DeclineLease(
        self, request: peer_pb2.DeclineLeaseRequest, context: Ctx
    ) -> peer_pb2.DeclineLeaseResponse:
        async def call() -> peer_pb2.DeclineLeaseResponse:
            session = self._session(context)
            held, view, released = self.d.owner.decline_lease(session, request.request_id)
            return peer_pb2.DeclineLeaseResponse(lease=self._lease(held, view, active=not released))

        return await rpc(self.d, "DeclineLease", context, call)

    async def Heartbeat(
        self, request: peer_pb2.HeartbeatRequest, context: Ctx
    ) -> peer_pb2.HeartbeatResponse:
        async def call() -> peer_pb2.HeartbeatResponse:
            session = self._session(context)
            lost, granted_s = self.d.owner.heartbeat(
                session, list(request.renew_request_ids), request.renew_ms / 1000
            )
            return peer_pb2.HeartbeatResponse(
                instance_id=self.d.instance_id,
                registration_generation=self.d.generation,
                lost_request_ids=lost,
                server_time_unix_ns=time.time_ns(),
                renewed_ms=int(granted_s * 1000),
            )

        return await rpc(self.d, "Heartbeat", context, call)

    async def Gather(
        self, request: peer_pb2.GatherRequest, context: Ctx
    ) -> peer_pb2.GatherResponse:
        async def call() -> peer_pb2.GatherResponse:
            reader = self._session(context).reader
            return await gather(self.d, request, context.time_remaining(), reader)

        return await rpc(self.d, "Gather", context, call)

    async def ReleaseStaging(
        self, request: peer_pb2.ReleaseStagingRequest, context: Ctx
    ) -> peer_pb2.ReleaseStagingResponse:
        async def call() -> peer_pb2.ReleaseStagingResponse:
            return await release_staging(self.d, request, self._session(context).reader)

        return await rpc(self.d, "ReleaseStaging", context, call)

    async def Stage(  # type: ignore[override]  # a coroutine that writes (grpc.aio allows it)
        self, request_iterator: AsyncIterator[peer_pb2.StageRequest], context: Ctx
    ) -> None:
        """Answers with context.write (no queue between the gather and the wire); errors end
        the stream with their status like every other call."""

        async def call() -> None:
            # The opening is read first, so an undecodable one is INVALID_ARGUMENT before the
            # session is checked, as a unary call's body is decoded before its handler runs.
            requests = aiter(request_iterator)
            first = await anext(requests, None)
            reader = self._session(context).reader
            await serve_stage(self.d, reader, first, requests, context)

        await rpc(self.d, "Stage", context, call)

    async def Push(self, request: peer_pb2.PushRequest, context: Ctx) -> peer_pb2.PushResponse:
        async def call() -> peer_pb2.PushResponse:
            return await push(self.d, request, self._session(context))

        return await rpc(self.d, "Push", context, call)


async def serve_stage(
    daemon: Daemon,
    reader: str,
    first: peer_pb2.StageRequest | None,
    requests: AsyncIterator[peer_pb2.StageRequest],
    context: Ctx,
) -> None:
    """One Stage stream for ``reader`` (the caller's session): check its opening message
    (``first``; None when the stream closed before it) as a Gather is checked, then announce
    chunk after chunk as credits come back on ``requests`` (peer.proto)."""
    owner = _owner(daemon)
    if first is None:
        return  # closed before opening: nothing to serve
    if not first.HasField("open") or first.read_slots:
        raise InvalidRequest(
            "the first message of a Stage stream must set open, and nothing else",
            field="open",
            fix="open the stream with the pull (StageOpen), then return slots as they are read",
        )
    o = first.open
    if daemon.leases.is_reading(o.request_id, reader) is False:
        raise PermissionDenied(
            f"this caller has no share of the lease of {o.request_id!r} that it is reading",
            field="open.request_id",
            fix="ConfirmLease before Stage; a share that ended cannot gather",
        )
    ids = [list(g.ids) for g in o.kernel_block_ids.groups]
    want = StageOpen(o.request_id, ids, o.chunk_bytes, o.chunks, o.credits)
    stream = StageStream.open(owner, reader, want, context.time_remaining())

    async def returns() -> AsyncIterator[Sequence[int]]:
        async for req in requests:
            if req.HasField("open"):
                raise InvalidRequest(
                    "open was sent again on an opened Stage stream",
                    field="open",
                    fix="open one stream per pull; later messages carry read_slots only",
                )
            yield req.read_slots

    async def send(a: Announce) -> None:
        await context.write(
            peer_pb2.StageResponse(
                chunk=a.chunk,
                slot=a.slot,
                offset=a.offset,
                nbytes=a.nbytes,
                gather_us=int(a.gather_s * 1e6),
                start_us=int(a.start_s * 1e6),
                slot_wait_us=int(a.slot_wait_s * 1e6),
            )
        )

    await stream.run(returns(), send)


__all__ = ["PeerService", "serve_stage"]
