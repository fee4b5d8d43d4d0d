"""One transfer on the NIXL binding's agent: check the descriptor pairs, post, read the
telemetry, release. Called on the NIXL thread by :class:`~kvxferd.nixl.agent.NixlAgent`."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvxferd.errors import InvalidRequest, PeerUnavailable, TransportError
from kvxferd.logs import kv
from kvxferd.nixl.errors import map_nixl_error
from kvxferd.nixl.types import Int64Array, MemType, XferOp, XferTelemetry, check_descs

log = logging.getLogger(__name__)


@dataclass
class XferHandle:
    """A posted transfer. Release it exactly once (``NixlAgent.release``), on every path."""

    peer: str
    op: XferOp
    nbytes: int
    descriptors: int
    posted_at: float
    _handle: Any = field(repr=False)
    released: bool = False


class PostArgs(NamedTuple):
    op: XferOp
    local: Int64Array
    remote: Int64Array
    peer: str
    mems: tuple[MemType, MemType]
    notif: bytes


def post_xfer(
    agent: Any, req: PostArgs, *, agent_name: str, remotes: Collection[str]
) -> XferHandle:
    """Create and post one transfer of paired descriptors to a peer in ``remotes`` (those
    loaded on the agent); the inputs are checked first, and nothing leaks on failure."""
    op, local, remote, peer, mems, notif = req
    loc = check_descs(local, "local")
    rem = check_descs(remote, "remote")
    if loc.shape[0] != rem.shape[0] or loc.shape[0] == 0:
        raise InvalidRequest(
            f"local has {loc.shape[0]} descriptors, remote {rem.shape[0]}",
            fix="pair every local range with one remote range of the same length",
        )
    if not np.array_equal(loc[:, 1], rem[:, 1]):
        raise InvalidRequest(
            "local and remote descriptor lengths differ", fix="pair ranges of equal length"
        )
    if peer not in remotes:
        raise PeerUnavailable(
            f"peer {peer!r} is not loaded on agent {agent_name}",
            fix="handshake with the peer (add_remote) before posting",
        )
    t0 = time.monotonic()
    handle = None
    try:
        ldescs = agent.get_xfer_descs(loc, mems[0].value)
        rdescs = agent.get_xfer_descs(rem, mems[1].value)
        if ldescs is None or rdescs is None:
            raise InvalidRequest(
                "NIXL refused the descriptor arrays",
                fix="pass N x 3 int64 arrays with a valid memory type",
            )
        handle = agent.initialize_xfer(op.value, ldescs, rdescs, peer, notif)
        if handle is None:
            raise TransportError("NIXL returned no transfer handle")
        agent.transfer(handle)
    except Exception as exc:
        if handle is not None:
            release_raw(agent, handle, peer, agent_name=agent_name)
        raise map_nixl_error(exc, op=f"post {op.value}", peer=peer) from exc
    return XferHandle(
        peer=peer,
        op=op,
        nbytes=int(loc[:, 1].sum()),
        descriptors=int(loc.shape[0]),
        posted_at=t0,
        _handle=handle,
    )


def read_telemetry(agent: Any, handle: XferHandle) -> XferTelemetry | None:
    """NIXL's figures for a completed transfer; None where NIXL has none."""
    try:
        t = agent.get_xfer_telemetry(handle._handle)
    except Exception:
        return None
    return XferTelemetry(
        post_us=int(t.postDuration),
        xfer_us=int(t.xferDuration),
        total_bytes=int(t.totalBytes),
        descriptors=int(t.descCount),
    )


def release_raw(agent: Any, raw: Any, peer: str, *, agent_name: str) -> bool:
    """Release a binding handle; False (logged) when NIXL refused, so the caller retries."""
    try:
        agent.release_xfer_handle(raw)
    except Exception as exc:
        log.warning(
            "releasing a NIXL transfer handle failed",
            extra=kv(
                agent=agent_name,
                peer=peer,
                error=str(map_nixl_error(exc, op="release", peer=peer)),
            ),
        )
        return False
    return True


__all__ = ["PostArgs", "XferHandle", "post_xfer", "read_telemetry", "release_raw"]
