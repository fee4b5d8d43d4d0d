"""One error type for every failed Scheduler call."""

from __future__ import annotations

from typing import Any

import grpc
from grpc import aio

from kvxferd.client.values import ErrorInfo
from kvxferd.v1 import common_pb2
from kvxferd.wire.peer_client import RpcFailure  # what the scheduler socket raises

ERROR_TRAILER = "kvxferd-error-bin"
"""The trailer that carries the daemon's typed error (a serialized ``ErrorDetail``)."""


class KvxferdRpcError(Exception):
    """A failed call: its gRPC status code, message and, when sent, the daemon's error."""

    def __init__(
        self, method: str, code: grpc.StatusCode, details: str, error: ErrorInfo | None
    ) -> None:
        self.method = method
        self.code = code
        self.details = details
        self.error = error
        super().__init__(f"{method}: {code.name}: {details}")

    @classmethod
    def wrap(cls, method: str, exc: grpc.RpcError) -> KvxferdRpcError:
        shaped = isinstance(exc, grpc.Call | aio.AioRpcError | RpcFailure)
        code = exc.code() if shaped else None
        details = exc.details() if shaped else str(exc)
        trailer: Any = ()
        if shaped:
            trailer = exc.trailing_metadata() or ()
        error = None
        for key, value in trailer:
            if key == ERROR_TRAILER and isinstance(value, bytes):
                try:
                    error = ErrorInfo.from_proto(common_pb2.ErrorDetail.FromString(value))
                except Exception:
                    error = None
        return cls(method, code or grpc.StatusCode.UNKNOWN, details or "", error)


__all__ = ["ERROR_TRAILER", "KvxferdRpcError"]
