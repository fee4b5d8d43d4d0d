"""kvxferd.client: a typed client of a kvxferd daemon's Scheduler service, for schedulers.

A scheduler (a router, llm-d, Dynamo, a custom one) tells a decode worker's daemon to pull a
request's KV blocks from a prefill worker's daemon, follows the pull, cancels it, declines a
held request it will not pull after all, lists the daemon's peers and checks blocks::

    from kvxferd.client import SchedulerClient

    with SchedulerClient("decode-0:50051", token=TOKEN) as decode:
        started = decode.start_pull(
            request_id="req-42",
            peer_address=hold.peer_address,  # what the prefill engine's Hold returned
            remote_block_ids=[[3, 9, 10]],  # one list per KV cache group
            local_block_ids=[[120, 121, 122]],
        )
        status = decode.wait(started.status.transfer_id, timeout_s=30)
        assert status.state is TransferState.DONE, status.error

:class:`AsyncSchedulerClient` is the same API for asyncio (``grpc.aio``).

Retries: idempotent calls are retried on ``UNAVAILABLE`` by gRPC itself, through the
channel's service config (:data:`SERVICE_CONFIG`; ``retry=False`` turns it off).
``StartPull`` is idempotent because the client gives every pull a ``transfer_id`` up front
(the daemon answers a repeated ``StartPull`` with the pull it already has); ``CancelTransfer``,
``GetTransfer``, ``ListPeers``, ``Checksum`` and ``WatchTransfers`` (before its first message)
are idempotent by nature.

Errors are :class:`KvxferdRpcError`: the gRPC status code, the message, and the daemon's typed
error (kind, field, fix, every mismatch) when it sent one.

This package needs only ``grpcio`` and ``protobuf`` (not torch, NIXL or numpy): install
``kvxferd`` without extras. The ``.proto`` files ship inside the package
(:func:`proto_dir`) for clients in other languages.
"""

from __future__ import annotations

from kvxferd.client.async_client import AsyncSchedulerClient
from kvxferd.client.errors import KvxferdRpcError
from kvxferd.client.requests import SERVICE_CONFIG, proto_dir, proto_files
from kvxferd.client.sync_client import SchedulerClient
from kvxferd.client.values import (
    ChecksumAlgorithm,
    Declined,
    ErrorInfo,
    Mismatch,
    PeerState,
    PeerStatus,
    StartedPull,
    TransferState,
    TransferStatus,
    TransferStrategy,
)

__all__ = [
    "SERVICE_CONFIG",
    "AsyncSchedulerClient",
    "ChecksumAlgorithm",
    "Declined",
    "ErrorInfo",
    "KvxferdRpcError",
    "Mismatch",
    "PeerState",
    "PeerStatus",
    "SchedulerClient",
    "StartedPull",
    "TransferState",
    "TransferStatus",
    "TransferStrategy",
    "proto_dir",
    "proto_files",
]
from kvxferd.client import ranks as ranks  # multi-rank pulls (docs/tp.md)
