"""The engine side of attachment: a synchronous client for the daemon's Engine service.

Engine authors need no gRPC: :class:`EngineClient` attaches the KV cache (OWNED: the daemon
allocates and the engine gets tensors mapped onto the daemon's memory; IMPORTED: the engine
passes its own tensors, DRAM from :func:`shared_tensors` or CUDA tensors, which the daemon serves
with same-host KERNEL pulls only), holds finished requests, delivers releases from
the session stream on a background thread, and detaches. See docs/attachment.md.

Must not import: ``nixl``, ``kvxferd.daemon``, ``kvxferd.service`` servicers (only the
protobuf conversions in :mod:`kvxferd.wire.codec`).
"""

from kvxferd.engine.client import (
    Attachment,
    EngineClient,
    HoldTicket,
    PoolState,
    ReleaseEvent,
    shared_tensors,
)

__all__ = [
    "Attachment",
    "EngineClient",
    "HoldTicket",
    "PoolState",
    "ReleaseEvent",
    "shared_tensors",
]
