"""The one table from kvxferd errors to gRPC status codes, and the abort helper.

Servicers never pick status codes themselves: they raise :mod:`kvxferd.errors` exceptions and
:func:`status_for` decides. Anything that is not a ``KvxferdError`` is a bug and becomes
``INTERNAL`` with a message that says so (the daemon keeps serving).
"""

from __future__ import annotations

import grpc

from kvxferd import errors as e

STATUS_TABLE: tuple[tuple[type[e.KvxferdError], grpc.StatusCode], ...] = (
    # Most specific first: BlockRangeError is an InvalidRequest.
    (e.BlockRangeError, grpc.StatusCode.INVALID_ARGUMENT),
    (e.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (e.SpecError, grpc.StatusCode.INVALID_ARGUMENT),
    (e.ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (e.IncompatiblePeer, grpc.StatusCode.FAILED_PRECONDITION),
    (e.LeaseRefused, grpc.StatusCode.FAILED_PRECONDITION),
    (e.PeerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (e.TransportError, grpc.StatusCode.UNAVAILABLE),
    (e.EngineDetached, grpc.StatusCode.UNAVAILABLE),
    (e.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (e.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.NotFound, grpc.StatusCode.NOT_FOUND),
    (e.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (e.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (e.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (e.Cancelled, grpc.StatusCode.CANCELLED),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in STATUS_TABLE:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def message_for(exc: BaseException) -> str:
    if isinstance(exc, e.KvxferdError):
        return str(exc)
    return f"internal error ({type(exc).__name__}: {exc}); this is a kvxferd bug, please report it"
