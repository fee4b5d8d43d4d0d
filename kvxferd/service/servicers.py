"""The three gRPC servicers (Peer, Scheduler, Engine): decode, call the daemon, encode.

One module each (:mod:`~kvxferd.service.peer_service`,
:mod:`~kvxferd.service.scheduler_service`, :mod:`~kvxferd.service.engine_service`). Errors
travel only as status codes: every handler runs inside :func:`kvxferd.service.rpc.rpc`, which
maps :mod:`kvxferd.errors` through the one table in :mod:`kvxferd.wire.errors` and turns
anything else into INTERNAL (logged with its traceback); the daemon keeps serving either way.
"""

from __future__ import annotations

from kvxferd.service.engine_service import EngineService
from kvxferd.service.peer_service import PeerService
from kvxferd.service.scheduler_service import SchedulerService, status_to_proto

__all__ = ["EngineService", "PeerService", "SchedulerService", "status_to_proto"]
