"""The Engine service's refusals as kvxferd errors (the engine author catches those)."""

from __future__ import annotations

import grpc

from kvxferd.errors import KvxferdError


def refused(exc: grpc.RpcError, what: str) -> KvxferdError:
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    from kvxferd import errors as e

    cls: type[KvxferdError] = {
        grpc.StatusCode.INVALID_ARGUMENT: e.InvalidRequest,
        grpc.StatusCode.ALREADY_EXISTS: e.AlreadyExists,
        grpc.StatusCode.NOT_FOUND: e.NotFound,
        grpc.StatusCode.FAILED_PRECONDITION: e.LeaseRefused,
        grpc.StatusCode.UNAVAILABLE: e.PeerUnavailable,
        grpc.StatusCode.RESOURCE_EXHAUSTED: e.ResourceExhausted,
        grpc.StatusCode.UNAUTHENTICATED: e.Unauthenticated,
    }.get(code, e.KvxferdError)  # type: ignore[arg-type]
    name = code.name if code is not None else "ERROR"
    return cls(f"{what} refused by the daemon ({name}): {detail}")


__all__ = ["refused"]
