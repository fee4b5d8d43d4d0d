"""Peer-service handler of push mode (Peer.Push): decode, call the daemon's pusher, encode.

Thin, like every servicer; the checks (the caller's share, the held IDs, both sides' bounds)
are :class:`kvxferd.daemon.pusher.Pusher`'s. Errors are raised as :mod:`kvxferd.errors` and
mapped to status codes by the servicers' one table.
"""

from __future__ import annotations

from kvxferd.daemon.core import Daemon
from kvxferd.daemon.pusher import PushOrder
from kvxferd.daemon.sessions import PeerSession
from kvxferd.transfer import notify
from kvxferd.v1 import peer_pb2
from kvxferd.wire.codec import group_ids_from_proto


async def push(
    daemon: Daemon, req: peer_pb2.PushRequest, session: PeerSession
) -> peer_pb2.PushResponse:
    """WRITE ``req``'s blocks into the caller's (``session``'s) and answer once written."""
    notify.check_request_id(req.request_id)
    order = PushOrder(
        request_id=req.request_id,
        remote_ids=tuple(group_ids_from_proto(req.remote_block_ids)),
        local_ids=tuple(group_ids_from_proto(req.local_block_ids)),
        ticket=req.notif_ticket,
        timeout_s=req.write_timeout_ms / 1000,
        transfer_id=req.transfer_id,
    )
    done = await daemon.pusher.push(session, order)
    return peer_pb2.PushResponse(
        nbytes=done.nbytes,
        descriptors=done.descriptors,
        elapsed_us=int(done.elapsed_s * 1e6),
        instance_id=daemon.instance_id,
    )
