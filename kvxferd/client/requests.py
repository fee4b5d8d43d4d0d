"""What both clients send: channel options (retries through gRPC's service config), call
metadata and request messages; and the ``.proto`` files shipped for other languages."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

from kvxferd.v1 import common_pb2, scheduler_pb2

MAX_MESSAGE_BYTES = 64 << 20
_SCHEDULER = "kvxferd.v1.Scheduler"

SERVICE_CONFIG: dict[str, Any] = {
    "methodConfig": [
        {
            # Idempotent calls (StartPull: through its transfer_id, set by this client).
            "name": [
                {"service": _SCHEDULER, "method": m}
                for m in (
                    "StartPull",
                    "GetTransfer",
                    "CancelTransfer",
                    "DeclinePull",
                    "ListPeers",
                    "Checksum",
                    "WatchTransfers",
                )
            ],
            "retryPolicy": {
                "maxAttempts": 4,
                "initialBackoff": "0.1s",
                "maxBackoff": "2s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
}
"""gRPC service config of the client's channels: up to 4 attempts on UNAVAILABLE (daemon
restarting, connection reset), 0.1 s backoff doubling up to 2 s. A streaming call is retried
only until its first message arrives (gRPC's rule)."""


def proto_dir() -> Traversable:
    """The folder of the ``.proto`` files of ``kvxferd.v1`` shipped in the package (import
    path root: ``kvxferd/v1/scheduler.proto`` etc. lie under it)."""
    return resources.files("kvxferd") / "proto"


def proto_files() -> dict[str, str]:
    """Every shipped ``.proto`` file: import path (``kvxferd/v1/scheduler.proto``) -> text."""
    base = proto_dir() / "kvxferd" / "v1"
    return {
        f"kvxferd/v1/{p.name}": p.read_text(encoding="utf-8")
        for p in sorted(base.iterdir(), key=lambda t: t.name)
        if p.name.endswith(".proto")
    }


BlockIds = Sequence[Sequence[int]] | common_pb2.GroupBlockIds


def block_ids(ids: BlockIds, what: str) -> common_pb2.GroupBlockIds:
    if isinstance(ids, common_pb2.GroupBlockIds):
        return ids
    if isinstance(ids, str | bytes) or not all(
        isinstance(g, Sequence | Iterable) and not isinstance(g, str | bytes) for g in ids
    ):
        raise TypeError(f"{what}: one sequence of block IDs per KV cache group, e.g. [[1, 2, 3]]")
    return common_pb2.GroupBlockIds(groups=[common_pb2.BlockIds(ids=list(g)) for g in ids])


def start_request(
    *,
    request_id: str,
    peer_address: str,
    remote_block_ids: BlockIds,
    local_block_ids: BlockIds,
    transfer_id: str,
    deadline_ms: int,
    skip_notify: bool,
    wait: bool = False,
) -> scheduler_pb2.StartPullRequest:
    return scheduler_pb2.StartPullRequest(
        transfer_id=transfer_id or uuid.uuid4().hex,
        request_id=request_id,
        peer_address=peer_address,
        remote_block_ids=block_ids(remote_block_ids, "remote_block_ids"),
        local_block_ids=block_ids(local_block_ids, "local_block_ids"),
        deadline_ms=deadline_ms,
        options=scheduler_pb2.PullOptions(skip_notify=skip_notify),
        wait=wait,
    )


def channel_options(retry: bool, extra: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    opts: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.enable_retries", 1 if retry else 0),
    ]
    if retry:
        opts.append(("grpc.service_config", json.dumps(SERVICE_CONFIG)))
    return [*opts, *extra]


def metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


# --- sync -----------------------------------------------------------------------------------
__all__ = [
    "SERVICE_CONFIG",
    "BlockIds",
    "block_ids",
    "channel_options",
    "metadata",
    "proto_dir",
    "proto_files",
    "start_request",
]
