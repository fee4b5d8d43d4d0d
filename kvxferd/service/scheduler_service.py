"""The Scheduler service: pulls started, followed and cancelled; peers listed; blocks checked."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator

from kvxferd.daemon.core import Daemon
from kvxferd.daemon.decline import decline
from kvxferd.daemon.peers import LinkState
from kvxferd.daemon.pulls import PullRecord, PullRequest, PullState
from kvxferd.errors import InvalidRequest, KvxferdError
from kvxferd.ipc.host import host_id
from kvxferd.service.rpc import Ctx, rpc
from kvxferd.service.staging import stage_times_to_proto
from kvxferd.v1 import (
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from kvxferd.wire.codec import group_ids_from_proto, group_ids_to_proto
from kvxferd.wire.errors import kind_of, message_for, status_for, trailer_for

log = logging.getLogger(__name__)


PULL_STATES = {
    PullState.PENDING: scheduler_pb2.TRANSFER_STATE_PENDING,
    PullState.HANDSHAKING: scheduler_pb2.TRANSFER_STATE_HANDSHAKING,
    PullState.CONFIRMING: scheduler_pb2.TRANSFER_STATE_CONFIRMING,
    PullState.TRANSFERRING: scheduler_pb2.TRANSFER_STATE_TRANSFERRING,
    PullState.DONE: scheduler_pb2.TRANSFER_STATE_DONE,
    PullState.FAILED: scheduler_pb2.TRANSFER_STATE_FAILED,
    PullState.CANCELLED: scheduler_pb2.TRANSFER_STATE_CANCELLED,
    PullState.EXPIRED: scheduler_pb2.TRANSFER_STATE_EXPIRED,
}
LINK_STATES = {
    LinkState.NEW: scheduler_pb2.HANDSHAKE_STATE_CONNECTING,
    LinkState.HANDSHAKING: scheduler_pb2.HANDSHAKE_STATE_CONNECTING,
    LinkState.READY: scheduler_pb2.HANDSHAKE_STATE_READY,
    LinkState.REFUSED: scheduler_pb2.HANDSHAKE_STATE_REFUSED,
    LinkState.UNREACHABLE: scheduler_pb2.HANDSHAKE_STATE_UNREACHABLE,
    LinkState.STALE: scheduler_pb2.HANDSHAKE_STATE_STALE,
}
STRATEGIES = {
    "DIRECT": scheduler_pb2.TRANSFER_STRATEGY_DIRECT,
    "STAGED": scheduler_pb2.TRANSFER_STRATEGY_STAGED,
    "KERNEL": scheduler_pb2.TRANSFER_STRATEGY_KERNEL,
    "CMA": scheduler_pb2.TRANSFER_STRATEGY_CMA,
}


def status_to_proto(rec: PullRecord) -> scheduler_pb2.TransferStatus:
    msg = scheduler_pb2.TransferStatus()
    fill_status(msg, rec)
    return msg


def fill_status(msg: scheduler_pb2.TransferStatus, rec: PullRecord) -> None:
    """Write ``rec`` into an empty ``msg`` (a response's own ``status``: no copy)."""
    msg.transfer_id = rec.transfer_id
    msg.request_id = rec.request_id
    msg.peer_address = rec.peer_address
    msg.state = PULL_STATES[rec.state]
    msg.nbytes = rec.nbytes
    msg.descriptors_before_coalescing = rec.naive_descriptors
    msg.descriptors_after_coalescing = rec.posted_descriptors
    msg.strategy = STRATEGIES.get(rec.strategy, scheduler_pb2.TRANSFER_STRATEGY_UNSPECIFIED)
    msg.strategy_reason = rec.strategy_reason
    msg.created_unix_ns = rec.created_ns
    msg.started_unix_ns = rec.started_ns
    msg.finished_unix_ns = rec.finished_ns
    msg.deadline_unix_ns = rec.deadline_ns
    msg.revision = rec.revision
    if rec.error is not None:  # common.proto's ErrorDetail: the class, and each part alone
        msg.error.kind = kind_of(rec.error)
        msg.error.message = rec.error.message
        msg.error.field = rec.error.field
        msg.error.fix = rec.error.fix
    if rec.stage_times is not None:
        msg.stage_times.CopyFrom(stage_times_to_proto(rec.stage_times))
    stages = msg.stages
    for name, seconds in rec.stages:
        stages.add(name=name, seconds=seconds)
    if rec.invalid_local_blocks:  # scheduler.proto: logical IDs, as the caller sent them
        msg.invalid_local_block_ids.CopyFrom(group_ids_to_proto(list(rec.invalid_logical())))


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    async def StartPull(
        self, request: scheduler_pb2.StartPullRequest, context: Ctx
    ) -> scheduler_pb2.StartPullResponse:
        received = time.monotonic()

        async def call() -> scheduler_pb2.StartPullResponse:
            deadline_ms = request.deadline_ms or int(self.d.limits.default_deadline_s * 1000)
            # The identity of the request (its transfer_id's idempotency) is every field but
            # wait, which only says how the caller hears of the result (scheduler.proto).
            wait = request.wait
            request.ClearField("wait")
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
                received=received,
            )
            rec, created = await self.d.reader.start_pull(req)
            if wait:  # the proto's contract: answer with the terminal status
                rec = await self.d.reader.pulls.wait_terminal(rec.transfer_id)
            resp = scheduler_pb2.StartPullResponse(created=created)
            fill_status(resp.status, rec)
            return resp

        return await rpc(self.d, "StartPull", context, call)

    async def WatchTransfers(
        self, request: scheduler_pb2.WatchTransfersRequest, context: Ctx
    ) -> AsyncIterator[scheduler_pb2.WatchTransfersResponse]:
        ids = frozenset(request.transfer_ids)
        notify = self.d.metrics.pull_stage_seconds.labels("notify")
        since = time.time_ns()  # pulls that ended before the watch are in its snapshot
        try:
            stream = self.d.reader.pulls.follow(ids)
            try:
                await context.send_initial_metadata(())  # registered: see the proto's comment
                async for rec in stream:
                    msg = scheduler_pb2.WatchTransfersResponse(status=status_to_proto(rec))
                    if rec.state is PullState.DONE and rec.finished_ns >= since:
                        # From the terminal status to this watcher's message, built and about to
                        # be handed to gRPC. Observed before the yield: the generator resumes
                        # only when gRPC wants the next message, and a watcher that cancels on
                        # the terminal status closes it at the yield, so an observation after
                        # it would be lost whenever the caller is quick.
                        notify.observe(max(0.0, (time.time_ns() - rec.finished_ns) / 1e9))
                    yield msg
            finally:
                stream.close()
        except KvxferdError as err:
            context.set_trailing_metadata(trailer_for(err))
            await context.abort(status_for(err), message_for(err))

    async def GetTransfer(
        self, request: scheduler_pb2.GetTransferRequest, context: Ctx
    ) -> scheduler_pb2.GetTransferResponse:
        async def call() -> scheduler_pb2.GetTransferResponse:
            rec = self.d.reader.pulls.get(request.transfer_id)
            return scheduler_pb2.GetTransferResponse(status=status_to_proto(rec))

        return await rpc(self.d, "GetTransfer", context, call)

    async def CancelTransfer(
        self, request: scheduler_pb2.CancelTransferRequest, context: Ctx
    ) -> scheduler_pb2.CancelTransferResponse:
        async def call() -> scheduler_pb2.CancelTransferResponse:
            rec = await self.d.reader.cancel(request.transfer_id)
            return scheduler_pb2.CancelTransferResponse(status=status_to_proto(rec))

        return await rpc(self.d, "CancelTransfer", context, call)

    async def DeclinePull(
        self, request: scheduler_pb2.DeclinePullRequest, context: Ctx
    ) -> scheduler_pb2.DeclinePullResponse:
        async def call() -> scheduler_pb2.DeclinePullResponse:
            deadline_ms = request.deadline_ms or int(self.d.limits.default_deadline_s * 1000)
            out = await decline(
                self.d.reader, request.peer_address, request.request_id, deadline_ms / 1000
            )
            return scheduler_pb2.DeclinePullResponse(
                released=out.released,
                readers_expected=out.readers_expected,
                readers_confirmed=out.readers_confirmed,
            )

        return await rpc(self.d, "DeclinePull", context, call)

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
                    handshake_state=LINK_STATES[link.state],
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

        return await rpc(self.d, "ListPeers", context, call)

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

        return await rpc(self.d, "Checksum", context, call)


__all__ = ["LINK_STATES", "PULL_STATES", "STRATEGIES", "SchedulerService", "status_to_proto"]
