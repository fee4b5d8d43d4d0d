"""The Engine service: the engine beside this daemon attaches, holds, follows releases, detaches."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from kvxferd.daemon.attach import Attacher
from kvxferd.daemon.core import Daemon
from kvxferd.daemon.owner import Release
from kvxferd.errors import InvalidRequest, KvxferdError, StateConflict
from kvxferd.logs import kv
from kvxferd.service.attaching import attach_request_from_proto, pool_info
from kvxferd.service.rpc import Ctx, rpc
from kvxferd.transfer import ReleaseReason
from kvxferd.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
)
from kvxferd.wire.codec import group_ids_from_proto, group_ids_to_proto
from kvxferd.wire.errors import message_for, status_for, trailer_for

log = logging.getLogger(__name__)


RELEASE_REASONS = {
    ReleaseReason.DONE: common_pb2.RELEASE_REASON_DONE,
    ReleaseReason.EXPIRED: common_pb2.RELEASE_REASON_EXPIRED,
    ReleaseReason.CANCELLED: common_pb2.RELEASE_REASON_CANCELLED,
    ReleaseReason.ENGINE_DETACHED: common_pb2.RELEASE_REASON_ENGINE_DETACHED,
}


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

        return await rpc(self.d, "Attach", context, call)

    async def Describe(
        self, request: engine_pb2.DescribeRequest, context: Ctx
    ) -> engine_pb2.DescribeResponse:
        async def call() -> engine_pb2.DescribeResponse:
            return engine_pb2.DescribeResponse(pool=self._pool_info())

        return await rpc(self.d, "Describe", context, call)

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

        return await rpc(self.d, "Hold", context, call)

    async def WatchReleases(
        self, request: engine_pb2.WatchReleasesRequest, context: Ctx
    ) -> AsyncIterator[engine_pb2.WatchReleasesResponse]:
        q = self.d.owner.watch_releases(frozenset(request.request_ids))
        try:
            await context.send_initial_metadata(())  # registered: see the proto's comment
            while True:
                yield _release_to_proto(await q.get())
        except KvxferdError as err:  # it fell too far behind (kvxferd/daemon/backlog.py)
            context.set_trailing_metadata(trailer_for(err))
            await context.abort(status_for(err), message_for(err))
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
        q = self.d.owner.watch_releases(frozenset(), bounded=False)
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
                raise StateConflict(
                    "this daemon owns its pool; Detach only releases held requests with force",
                    field="force",
                    fix="set force = true to cancel every held request",
                )
            n = 0
            for rid in self.d.owner.held_request_ids():
                self.d.leases.cancel(rid)
                n += 1
            return engine_pb2.DetachResponse(released_requests=n)

        return await rpc(self.d, "Detach", context, call)


def _release_to_proto(rel: Release) -> engine_pb2.WatchReleasesResponse:
    return engine_pb2.WatchReleasesResponse(
        request_id=rel.request_id,
        reason=RELEASE_REASONS[rel.reason],
        block_ids=group_ids_to_proto(list(rel.logical_ids)),
        released_unix_ns=time.time_ns(),
    )


__all__ = ["EngineService"]
