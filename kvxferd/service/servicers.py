"""The three gRPC servicers (Peer, Scheduler, Engine): decode, call the daemon, encode.

Errors travel only as status codes: every handler runs inside :func:`_rpc`, which maps
:mod:`kvxferd.errors` through the one table in :mod:`kvxferd.wire.errors` and turns anything
else into INTERNAL (logged with its traceback); the daemon keeps serving either way.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc import aio

from kvxferd.daemon.attach import Attacher
from kvxferd.daemon.core import Daemon
from kvxferd.daemon.owner import HeldRequest, Release
from kvxferd.daemon.peers import LinkState, decode_envelope
from kvxferd.daemon.pulls import PullRecord, PullState
from kvxferd.daemon.reader import PullRequest
from kvxferd.daemon.sessions import SESSION_METADATA, PeerSession
from kvxferd.errors import InvalidRequest, KvxferdError
from kvxferd.ipc.host import host_id
from kvxferd.logs import kv
from kvxferd.service.attaching import attach_request_from_proto, pool_info
from kvxferd.service.push import push
from kvxferd.service.staging import gather, release_staging, stage_times_to_proto
from kvxferd.transfer import ReleaseReason
from kvxferd.transfer.leases import LeaseView
from kvxferd.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    peer_pb2,
    peer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from kvxferd.wire.codec import group_ids_from_proto, group_ids_to_proto
from kvxferd.wire.errors import message_for, status_for, trailer_for

log = logging.getLogger(__name__)

Ctx = aio.ServicerContext[Any, Any]
T = TypeVar("T")

_STATE = {
    PullState.PENDING: scheduler_pb2.TRANSFER_STATE_PENDING,
    PullState.HANDSHAKING: scheduler_pb2.TRANSFER_STATE_HANDSHAKING,
    PullState.CONFIRMING: scheduler_pb2.TRANSFER_STATE_CONFIRMING,
    PullState.TRANSFERRING: scheduler_pb2.TRANSFER_STATE_TRANSFERRING,
    PullState.DONE: scheduler_pb2.TRANSFER_STATE_DONE,
    PullState.FAILED: scheduler_pb2.TRANSFER_STATE_FAILED,
    PullState.CANCELLED: scheduler_pb2.TRANSFER_STATE_CANCELLED,
    PullState.EXPIRED: scheduler_pb2.TRANSFER_STATE_EXPIRED,
}
_LINK = {
    LinkState.NEW: scheduler_pb2.HANDSHAKE_STATE_CONNECTING,
    LinkState.HANDSHAKING: scheduler_pb2.HANDSHAKE_STATE_CONNECTING,
    LinkState.READY: scheduler_pb2.HANDSHAKE_STATE_READY,
    LinkState.REFUSED: scheduler_pb2.HANDSHAKE_STATE_REFUSED,
    LinkState.UNREACHABLE: scheduler_pb2.HANDSHAKE_STATE_UNREACHABLE,
    LinkState.STALE: scheduler_pb2.HANDSHAKE_STATE_STALE,
}
_STRATEGY = {
    "DIRECT": scheduler_pb2.TRANSFER_STRATEGY_DIRECT,
    "STAGED": scheduler_pb2.TRANSFER_STRATEGY_STAGED,
    "KERNEL": scheduler_pb2.TRANSFER_STRATEGY_KERNEL,
}
_REASON = {
    ReleaseReason.DONE: common_pb2.RELEASE_REASON_DONE,
    ReleaseReason.EXPIRED: common_pb2.RELEASE_REASON_EXPIRED,
    ReleaseReason.CANCELLED: common_pb2.RELEASE_REASON_CANCELLED,
    ReleaseReason.ENGINE_DETACHED: common_pb2.RELEASE_REASON_ENGINE_DETACHED,
}


async def _rpc(daemon: Daemon, method: str, context: Ctx, call: Callable[[], Awaitable[T]]) -> T:
    try:
        return await call()
    except KvxferdError as err:
        code = status_for(err)
        daemon.metrics.rpc_errors.labels(method, code.name).inc()
        log.info("rpc refused", extra=kv(method=method, code=code.name, error=str(err)))
        context.set_trailing_metadata(trailer_for(err))
        await context.abort(code, message_for(err))
    except (aio.AbortError, asyncio.CancelledError):
        raise
    except Exception as exc:
        daemon.metrics.rpc_errors.labels(method, "INTERNAL").inc()
        log.exception("rpc failed", extra=kv(method=method))
        await context.abort(grpc.StatusCode.INTERNAL, message_for(exc))
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


def status_to_proto(rec: PullRecord) -> scheduler_pb2.TransferStatus:
    msg = scheduler_pb2.TransferStatus(
        transfer_id=rec.transfer_id,
        request_id=rec.request_id,
        peer_address=rec.peer_address,
        state=_STATE[rec.state],
        nbytes=rec.nbytes,
        descriptors_before_coalescing=rec.naive_descriptors,
        descriptors_after_coalescing=rec.posted_descriptors,
        strategy=_STRATEGY.get(rec.strategy, scheduler_pb2.TRANSFER_STRATEGY_UNSPECIFIED),
        strategy_reason=rec.strategy_reason,
        created_unix_ns=rec.created_ns,
        started_unix_ns=rec.started_ns,
        finished_unix_ns=rec.finished_ns,
        deadline_unix_ns=rec.deadline_ns,
        revision=rec.revision,
    )
    if rec.error is not None:
        msg.error.message = str(rec.error)
        msg.error.field = rec.error.field
        msg.error.fix = rec.error.fix
    if rec.stage_times is not None:
        msg.stage_times.CopyFrom(stage_times_to_proto(rec.stage_times))
    for name, seconds in rec.stages:
        msg.stages.add(name=name, seconds=seconds)
    if rec.invalid_local_blocks:
        msg.invalid_local_block_ids.CopyFrom(group_ids_to_proto(list(rec.invalid_local_blocks)))
    return msg


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

        return await _rpc(self.d, "Handshake", context, call)

    def _lease(self, held: HeldRequest, view: LeaseView, active: bool = True) -> peer_pb2.Lease:
        remaining = max(0.0, view.expires_at - time.monotonic()) if active else 0.0
        return peer_pb2.Lease(
            request_id=held.request_id,
            state=peer_pb2.LEASE_STATE_ACTIVE if active else peer_pb2.LEASE_STATE_RELEASED,
            expires_unix_ns=time.time_ns() + int(remaining * 1e9),
            remaining_ms=int(remaining * 1000),
            block_ids=group_ids_to_proto(list(held.logical_ids)),
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

        return await _rpc(self.d, "ConfirmLease", context, call)

    async def ExtendLease(
        self, request: peer_pb2.ExtendLeaseRequest, context: Ctx
    ) -> peer_pb2.ExtendLeaseResponse:
        async def call() -> peer_pb2.ExtendLeaseResponse:
            session = self._session(context)
            held, view = self.d.owner.extend_lease(
                session, request.request_id, request.extend_ms / 1000
            )
            return peer_pb2.ExtendLeaseResponse(lease=self._lease(held, view))

        return await _rpc(self.d, "ExtendLease", context, call)

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

        return await _rpc(self.d, "ReleaseLease", context, call)

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

        return await _rpc(self.d, "Heartbeat", context, call)

    async def Gather(
        self, request: peer_pb2.GatherRequest, context: Ctx
    ) -> peer_pb2.GatherResponse:
        async def call() -> peer_pb2.GatherResponse:
            reader = self._session(context).reader
            return await gather(self.d, request, context.time_remaining(), reader)

        return await _rpc(self.d, "Gather", context, call)

    async def ReleaseStaging(
        self, request: peer_pb2.ReleaseStagingRequest, context: Ctx
    ) -> peer_pb2.ReleaseStagingResponse:
        async def call() -> peer_pb2.ReleaseStagingResponse:
            return await release_staging(self.d, request, self._session(context).reader)

        return await _rpc(self.d, "ReleaseStaging", context, call)

    async def Push(self, request: peer_pb2.PushRequest, context: Ctx) -> peer_pb2.PushResponse:
        async def call() -> peer_pb2.PushResponse:
            return await push(self.d, request, self._session(context))

        return await _rpc(self.d, "Push", context, call)


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    async def StartPull(
        self, request: scheduler_pb2.StartPullRequest, context: Ctx
    ) -> scheduler_pb2.StartPullResponse:
        async def call() -> scheduler_pb2.StartPullResponse:
            deadline_ms = request.deadline_ms or int(self.d.limits.default_deadline_s * 1000)
            fingerprint = hashlib.blake2b(
                request.SerializeToString(deterministic=True), digest_size=16
            ).digest()
            req = PullRequest(
                fingerprint=fingerprint,
                transfer_id=request.transfer_id or uuid.uuid4().hex,
                request_id=request.request_id,
                peer_address=request.peer_address,
                remote_ids=tuple(group_ids_from_proto(request.remote_block_ids)),
                local_ids=tuple(group_ids_from_proto(request.local_block_ids)),
                deadline_s=deadline_ms / 1000,
                notify=not request.options.skip_notify,
            )
            rec, created = await self.d.reader.start_pull(req)
            return scheduler_pb2.StartPullResponse(status=status_to_proto(rec), created=created)

        return await _rpc(self.d, "StartPull", context, call)

    async def WatchTransfers(
        self, request: scheduler_pb2.WatchTransfersRequest, context: Ctx
    ) -> AsyncIterator[scheduler_pb2.WatchTransfersResponse]:
        ids = frozenset(request.transfer_ids)
        try:
            stream = self.d.reader.watch(ids)
            async for rec in stream:
                yield scheduler_pb2.WatchTransfersResponse(status=status_to_proto(rec))
        except KvxferdError as err:
            context.set_trailing_metadata(trailer_for(err))
            await context.abort(status_for(err), message_for(err))

    async def GetTransfer(
        self, request: scheduler_pb2.GetTransferRequest, context: Ctx
    ) -> scheduler_pb2.GetTransferResponse:
        async def call() -> scheduler_pb2.GetTransferResponse:
            rec = self.d.reader.pulls.get(request.transfer_id)
            return scheduler_pb2.GetTransferResponse(status=status_to_proto(rec))

        return await _rpc(self.d, "GetTransfer", context, call)

    async def CancelTransfer(
        self, request: scheduler_pb2.CancelTransferRequest, context: Ctx
    ) -> scheduler_pb2.CancelTransferResponse:
        async def call() -> scheduler_pb2.CancelTransferResponse:
            rec = await self.d.reader.cancel(request.transfer_id)
            return scheduler_pb2.CancelTransferResponse(status=status_to_proto(rec))

        return await _rpc(self.d, "CancelTransfer", context, call)

    async def ListPeers(
        self, request: scheduler_pb2.ListPeersRequest, context: Ctx
    ) -> scheduler_pb2.ListPeersResponse:
        async def call() -> scheduler_pb2.ListPeersResponse:
            out = scheduler_pb2.ListPeersResponse()
            links = self.d.peers.links() if self.d.peers else []
            active = self.d.reader.pulls.active()
            for link in links:
                r = link.remote
                p = out.peers.add(
                    address=link.address,
                    handshake_state=_LINK[link.state],
                    last_handshake_unix_ns=link.last_handshake_ns,
                    active_transfers=sum(1 for a in active if a.peer_address == link.address),
                )
                if link.last_error:
                    p.last_error.message = link.last_error
                if r is not None:
                    p.nixl_agent_name = r.agent_name
                    p.registration_generation = r.generation
                    p.daemon_id = r.daemon_id
                    p.instance_id = r.instance_id
                    p.same_host = bool(r.host_id) and r.host_id == host_id()
                t = link.transport
                if t is not None:
                    p.read_transport = t.name
                    p.read_probe_gbps = 0.0 if math.isnan(t.read_gbps) else t.read_gbps
                    p.read_transport_detail = t.detail
            return out

        return await _rpc(self.d, "ListPeers", context, call)

    async def Checksum(
        self, request: scheduler_pb2.ChecksumRequest, context: Ctx
    ) -> scheduler_pb2.ChecksumResponse:
        async def call() -> scheduler_pb2.ChecksumResponse:
            if request.algorithm not in (
                scheduler_pb2.CHECKSUM_ALGORITHM_UNSPECIFIED,
                scheduler_pb2.CHECKSUM_ALGORITHM_BLAKE2B_64,
            ):
                raise InvalidRequest(
                    "only BLAKE2B_64 digests are implemented",
                    field="algorithm",
                    fix="leave algorithm unset or ask for BLAKE2B_64",
                )
            digests = await asyncio.to_thread(
                self.d.checksum,
                request.group_index,
                list(request.block_ids),
                kernel=request.kernel_block_ids,
            )
            return scheduler_pb2.ChecksumResponse(
                algorithm=scheduler_pb2.CHECKSUM_ALGORITHM_BLAKE2B_64, digests=digests
            )

        return await _rpc(self.d, "Checksum", context, call)


class EngineService(engine_pb2_grpc.EngineServicer):
    """The engine API. ``attacher`` is None when the daemon owns its pool (pool.mode = owned)."""

    def __init__(self, daemon: Daemon, attacher: Attacher | None = None) -> None:
        self.d = daemon
        self.attacher = attacher

    def _pool_info(self) -> engine_pb2.PoolInfo:
        return pool_info(self.d, self.attacher)

    async def Attach(
        self, request: engine_pb2.AttachRequest, context: Ctx
    ) -> engine_pb2.AttachResponse:
        async def call() -> engine_pb2.AttachResponse:
            if self.attacher is None:
                raise InvalidRequest(
                    "this daemon owns its KV pool (pool.mode = owned), so there is nothing to"
                    " attach; use Describe to learn the pool",
                    field="memory_mode",
                    fix="run the daemon with pool.mode = attached to attach engine memory",
                )
            await self.attacher.attach(attach_request_from_proto(request))
            return engine_pb2.AttachResponse(pool=self._pool_info())

        return await _rpc(self.d, "Attach", context, call)

    async def Describe(
        self, request: engine_pb2.DescribeRequest, context: Ctx
    ) -> engine_pb2.DescribeResponse:
        async def call() -> engine_pb2.DescribeResponse:
            return engine_pb2.DescribeResponse(pool=self._pool_info())

        return await _rpc(self.d, "Describe", context, call)

    async def Hold(self, request: engine_pb2.HoldRequest, context: Ctx) -> engine_pb2.HoldResponse:
        async def call() -> engine_pb2.HoldResponse:
            held = self.d.owner.hold(
                request.request_id,
                group_ids_from_proto(request.block_ids),
                request.expected_readers or 1,
                request.ttl_ms / 1000 or None,
            )
            remaining = max(0.0, held.lease.expires_at - time.monotonic())
            return engine_pb2.HoldResponse(
                peer_address=self.d.address,
                request_id=held.request_id,
                remote_block_ids=group_ids_to_proto(list(held.logical_ids)),
                expires_unix_ns=time.time_ns() + int(remaining * 1e9),
            )

        return await _rpc(self.d, "Hold", context, call)

    async def WatchReleases(
        self, request: engine_pb2.WatchReleasesRequest, context: Ctx
    ) -> AsyncIterator[engine_pb2.WatchReleasesResponse]:
        q = self.d.owner.watch_releases(frozenset(request.request_ids))
        try:
            while True:
                yield _release_to_proto(await q.get())
        finally:
            self.d.owner.unwatch_releases(q)

    async def Session(
        self, request: engine_pb2.SessionRequest, context: Ctx
    ) -> AsyncIterator[engine_pb2.SessionResponse]:
        if self.attacher is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "this daemon owns its KV pool (pool.mode = owned): there is no attachment to"
                " keep alive (fix: use WatchReleases for releases)",
            )
            return
        try:
            att = self.attacher.open_session(request.attachment_id)
        except KvxferdError as err:
            context.set_trailing_metadata(trailer_for(err))
            await context.abort(status_for(err), message_for(err))
            return
        q = self.d.owner.watch_releases(frozenset())
        log.info("engine session opened", extra=kv(attachment=att.attachment_id))
        ended = asyncio.ensure_future(att.ended.wait())
        get: asyncio.Future[Release] | None = None
        try:
            yield engine_pb2.SessionResponse(opened=self._pool_info())
            while not att.ended.is_set():
                get = asyncio.ensure_future(q.get())
                await asyncio.wait({get, ended}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    break
                yield engine_pb2.SessionResponse(release=_release_to_proto(get.result()))
        finally:
            ended.cancel()
            if get is not None:
                get.cancel()
            self.d.owner.unwatch_releases(q)
            log.info("engine session closed", extra=kv(attachment=att.attachment_id))
            self.attacher.session_ended(att)

    async def Detach(
        self, request: engine_pb2.DetachRequest, context: Ctx
    ) -> engine_pb2.DetachResponse:
        async def call() -> engine_pb2.DetachResponse:
            if self.attacher is not None:
                n = await self.attacher.detach(
                    "the engine called Detach",
                    attachment_id=request.attachment_id,
                    force=request.force,
                )
                return engine_pb2.DetachResponse(released_requests=n)
            if not request.force:
                raise InvalidRequest(
                    "this daemon owns its pool; Detach only releases held requests with force",
                    field="force",
                    fix="set force = true to cancel every held request",
                )
            n = 0
            for rid in self.d.owner.held_request_ids():
                self.d.leases.cancel(rid)
                n += 1
            return engine_pb2.DetachResponse(released_requests=n)

        return await _rpc(self.d, "Detach", context, call)


def _release_to_proto(rel: Release) -> engine_pb2.WatchReleasesResponse:
    return engine_pb2.WatchReleasesResponse(
        request_id=rel.request_id,
        reason=_REASON[rel.reason],
        block_ids=group_ids_to_proto(list(rel.logical_ids)),
        released_unix_ns=time.time_ns(),
    )


__all__ = ["EngineService", "PeerService", "SchedulerService", "status_to_proto"]
