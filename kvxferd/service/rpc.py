"""Every servicer handler runs inside :func:`rpc`: kvxferd errors become status codes through
the one table in :mod:`kvxferd.wire.errors` (with the structured trailer), anything else is
INTERNAL (logged with its traceback); the daemon keeps serving either way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc import aio

from kvxferd.daemon.core import Daemon
from kvxferd.errors import KvxferdError
from kvxferd.logs import kv
from kvxferd.wire.errors import message_for, status_for, trailer_for

log = logging.getLogger(__name__)


Ctx = aio.ServicerContext[Any, Any]
T = TypeVar("T")


async def rpc(daemon: Daemon, method: str, context: Ctx, call: Callable[[], Awaitable[T]]) -> T:
    try:
        return await call()
    except KvxferdError as err:
        code = status_for(err)
        daemon.metrics.rpc_errors.labels(method, code.name).inc()
        log.info("rpc refused", extra=kv(method=method, code=code.name, error=str(err)))
        context.set_trailing_metadata(trailer_for(err))
        await context.abort(code, message_for(err))
    except (aio.AbortError, asyncio.CancelledError):
        raise
    except Exception as exc:
        daemon.metrics.rpc_errors.labels(method, "INTERNAL").inc()
        log.exception("rpc failed", extra=kv(method=method))
        await context.abort(grpc.StatusCode.INTERNAL, message_for(exc))
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


__all__ = ["Ctx", "rpc"]
