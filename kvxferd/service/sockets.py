"""The sockets a daemon serves beside gRPC, as configured: the same-host Peer socket
(``peers.local_socket``, advertised in the handshake) and the scheduler socket
(``server.scheduler_socket``, advertised in Describe's PoolInfo). Both are
:class:`~kvxferd.service.local_peer.LocalPeerServer` instances; this module decides where they
live and what a path that cannot be served means.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from kvxferd.config import Config
from kvxferd.daemon.core import Daemon
from kvxferd.logs import kv
from kvxferd.metrics import Metrics
from kvxferd.service.local_peer import (
    MAX_CONNECTIONS,
    SCHEDULER,
    LocalPeerServer,
    socket_path,
    sweep_stale,
)
from kvxferd.wire.local import SCHEDULER_METHODS

log = logging.getLogger(__name__)


async def serve_local(
    cfg: Config, service: Any, metrics: Metrics, token: str, daemon: Daemon
) -> LocalPeerServer | None:
    """Start the same-host Peer socket ``peers.local_socket`` asks for and advertise it in
    the handshake; None when it is off or cannot be served (logged: pulls then use gRPC)."""
    path = socket_path(cfg.peers.local_socket, daemon.instance_id)
    if not path:
        return None
    if cfg.peers.local_socket == "auto":
        with contextlib.suppress(OSError):
            for stale in sweep_stale(os.path.dirname(path)):
                log.info("removed a dead daemon's Peer socket", extra=kv(socket=stale))
    try:
        server = LocalPeerServer(service, metrics, path, token)
        await server.start()
    except (OSError, ValueError) as exc:
        log.warning(
            "same-host Peer socket not served; Peer calls use gRPC only",
            extra=kv(socket=path, error=str(exc), fix="set peers.local_socket to a writable path"),
        )
        return None
    daemon.local_socket = path
    return server


def scheduler_connections(cfg: Config) -> int:
    """Connections the scheduler socket serves at once: a blocking caller (the vLLM connector)
    keeps one per pull it waits on, and the daemon runs up to transfer.max_inflight pulls;
    the rest is room for callers that poll or list peers meanwhile."""
    return cfg.transfer.max_inflight + MAX_CONNECTIONS


async def serve_scheduler(
    cfg: Config, service: Any, metrics: Metrics, token: str, daemon: Daemon
) -> LocalPeerServer | None:
    """Start the scheduler socket ``server.scheduler_socket`` names (None when empty) and
    advertise it in Describe's PoolInfo. It was asked for explicitly, so a path that cannot be
    served stops the daemon's start with why."""
    path = cfg.server.scheduler_socket
    if not path:
        return None
    try:
        server = LocalPeerServer(
            service,
            metrics,
            path,
            token,
            name=SCHEDULER,
            methods=SCHEDULER_METHODS,
            mode=0o660,
            max_connections=scheduler_connections(cfg),
        )
        await server.start()
    except (OSError, ValueError) as exc:
        raise OSError(
            f"server.scheduler_socket: cannot serve on {path}: {exc}; pick a writable path"
            " that no other daemon serves on, or leave it empty"
        ) from exc
    log.info("serving the scheduler socket", extra=kv(socket=path))
    daemon.scheduler_socket = path
    return server


async def serve_sockets(
    cfg: Config, peer: Any, scheduler: Any, metrics: Metrics, *, token: str, d: Daemon
) -> tuple[LocalPeerServer, ...]:
    """The same-host Peer socket and the scheduler socket, those configured and served."""
    servers = (
        await serve_local(cfg, peer, metrics, token, d),
        await serve_scheduler(cfg, scheduler, metrics, token, d),
    )
    return tuple(s for s in servers if s is not None)
