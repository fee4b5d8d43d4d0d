"""Peer-service handlers of STAGED pulls (Gather, ReleaseStaging) and stage-time encoding.

Thin, like every servicer: decode, call the daemon's staging owner, encode. Errors are raised
as :mod:`kvxferd.errors` and mapped to status codes by the servicers' one table.
"""

from __future__ import annotations

from kvxferd.daemon.core import Daemon
from kvxferd.errors import InvalidRequest, PermissionDenied
from kvxferd.staging.owner import StagingOwner
from kvxferd.staging.stats import StageTimes
from kvxferd.v1 import peer_pb2, scheduler_pb2


def _owner(daemon: Daemon) -> StagingOwner:
    owner = daemon.staging.owner if daemon.staging else None
    if owner is None:
        daemon.parts.slot.served()  # EngineDetached (saying so) while no engine is attached
        raise InvalidRequest(
            "this daemon has no staging ring, so it cannot gather",
            field="transfer.staging_chunks",
            fix="read this daemon with DIRECT (it advertises no ring), or set"
            " transfer.staging_chunks >= 2 on it",
        )
    return owner


async def gather(
    daemon: Daemon, req: peer_pb2.GatherRequest, time_left: float | None, reader: str
) -> peer_pb2.GatherResponse:
    """Gather for ``reader`` (the caller's handshake session, not ``req.reader_id``): only a
    reader that confirmed the lease and is still reading it may take staging slots."""
    owner = _owner(daemon)
    if daemon.leases.is_reading(req.request_id, reader) is False:
        raise PermissionDenied(
            f"this caller has no share of the lease of {req.request_id!r} that it is reading",
            field="request_id",
            fix="ConfirmLease before Gather; a share that ended cannot gather",
        )
    grant = await owner.gather(
        req.request_id,
        reader,
        [list(g.ids) for g in req.kernel_block_ids.groups],
        release=list(req.release_slots),
        timeout_s=time_left,
    )
    return peer_pb2.GatherResponse(
        slot=grant.slot,
        offset=grant.offset,
        nbytes=grant.nbytes,
        gather_us=int(grant.gather_s * 1e6),
    )


async def release_staging(
    daemon: Daemon, req: peer_pb2.ReleaseStagingRequest, reader: str
) -> peer_pb2.ReleaseStagingResponse:
    n = _owner(daemon).release(req.request_id, reader, list(req.slots))
    return peer_pb2.ReleaseStagingResponse(released=n)


def stage_times_to_proto(t: StageTimes) -> scheduler_pb2.StageTimes:
    return scheduler_pb2.StageTimes(
        chunks=t.chunks,
        gather_seconds=t.gather_s,
        gather_rpc_seconds=t.gather_rpc_s,
        read_seconds=t.read_s,
        scatter_seconds=t.scatter_s,
        slot_wait_seconds=t.slot_wait_s,
        stream=t.stream,
        control_seconds=t.control_s,
        owner_start_seconds=t.owner_start_s,
        owner_slot_wait_seconds=t.owner_slot_wait_s,
    )
