"""The Engine service's refusals as kvxferd errors (the engine author catches those)."""

from __future__ import annotations

import grpc

from kvxferd.errors import KvxferdError


def refused(exc: grpc.RpcError, what: str) -> KvxferdError:
    """The daemon's error class when its answer carried one (the ``kvxferd-error-bin``
    trailer: kvxferd/wire/errors.py), else the class the status code most likely means."""
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    from kvxferd import errors as e
    from kvxferd.wire.errors import class_of_detail, detail_from_rpc

    sent = detail_from_rpc(exc)
    by_kind = class_of_detail(sent) if sent is not None else None
    if sent is not None and by_kind is not None and by_kind is not e.IncompatiblePeer:
        name = code.name if code is not None else "ERROR"
        return by_kind(
            f"{what} refused by the daemon ({name}): {sent.message}", field=sent.field, fix=sent.fix
        )

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
