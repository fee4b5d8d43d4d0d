"""Authentication for every gRPC service: an optional shared token, optional mTLS.

The token travels as ``authorization: Bearer <token>`` metadata and is compared in constant
time. ``grpc.health.v1.Health`` stays open so that Kubernetes probes (which cannot send
headers) work; it reveals nothing but serving status. mTLS is configured on the port
(:func:`server_credentials`), so a client without a certificate never reaches a handler.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from kvxferd.config import AuthConfig
from kvxferd.errors import ConfigError

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
TOKEN_HINT = "send metadata 'authorization: Bearer <token>' with the daemon's auth.token"


class TokenInterceptor(aio.ServerInterceptor):  # type: ignore[type-arg]
    """Rejects calls without the configured bearer token with UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        if not token.strip():
            raise ConfigError("empty token", field="auth.token", fix="set a non-empty token")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        method: str = details.method
        if method.startswith(OPEN_PREFIXES):
            return await continuation(details)
        refusal = token_refusal(details.invocation_metadata or (), self._expected, method)
        if refusal is None:
            return await continuation(details)
        handler = await continuation(details)
        return _denying_like(handler, refusal)


def token_refusal(metadata: Iterable[tuple[str, Any]], expected: bytes, method: str) -> str | None:
    """Why a call to ``method`` carrying ``metadata`` is refused (None: its ``authorization``
    is the ``expected`` bearer token), compared in constant time."""
    got = b""
    for key, value in metadata:
        if key == "authorization":
            # surrogatepass: a lone surrogate (the sockets' JSON metadata can carry one) is
            # a wrong token, not an encoding error
            got = value.encode(errors="surrogatepass") if isinstance(value, str) else bytes(value)
    if hmac.compare_digest(got, expected):
        return None
    why = "missing token" if not got else "wrong token"
    return f"{why} for {method}: {TOKEN_HINT}"


def _denying_like(
    handler: grpc.RpcMethodHandler[Any, Any] | None, message: str
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same response shape as ``handler`` that aborts UNAUTHENTICATED.

    It takes the request body as raw bytes: nothing an unauthenticated caller sends is parsed.
    """

    async def unary(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield None  # pragma: no cover - abort raises

    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            streaming, response_serializer=handler.response_serializer
        )
    return grpc.unary_unary_rpc_method_handler(
        unary, response_serializer=handler.response_serializer if handler else None
    )


def _read(path: str, key: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}", field=key, fix="check the path") from exc


def server_credentials(cfg: AuthConfig) -> grpc.ServerCredentials | None:
    """TLS (and mTLS when ``tls_ca`` is set) credentials, or None for plaintext."""
    if not cfg.tls_cert:
        return None
    pair = (_read(cfg.tls_key, "auth.tls_key"), _read(cfg.tls_cert, "auth.tls_cert"))
    ca = _read(cfg.tls_ca, "auth.tls_ca") if cfg.tls_ca else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=ca, require_client_auth=ca is not None
    )


def channel_credentials(cfg: AuthConfig) -> grpc.ChannelCredentials | None:
    """Credentials a daemon uses to call its peers (same CA, own cert as client cert)."""
    if not cfg.tls_cert:
        return None
    ca = _read(cfg.tls_ca, "auth.tls_ca") if cfg.tls_ca else None
    return grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=_read(cfg.tls_key, "auth.tls_key"),
        certificate_chain=_read(cfg.tls_cert, "auth.tls_cert"),
    )


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()
