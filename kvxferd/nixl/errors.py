"""Translate NIXL's exceptions into :mod:`kvxferd.errors`, with a fix in every message.

NIXL raises typed exceptions from its bindings (``nixlRemoteDisconnectError`` and friends) and
signals bad input by returning ``None``. Nothing outside :mod:`kvxferd.nixl` sees either.
"""

from __future__ import annotations

from kvxferd.errors import (
    Cancelled,
    InvalidRequest,
    KvxferdError,
    PeerUnavailable,
    TransportError,
)
from kvxferd.nixl._binding import bindings


def _cls(name: str) -> type[BaseException]:
    found = getattr(bindings, name, None)
    if isinstance(found, type) and issubclass(found, BaseException):
        return found

    class _Never(Exception):
        """Placeholder for an exception this NIXL build does not define."""

    return _Never


_REMOTE_DISCONNECT = _cls("nixlRemoteDisconnectError")
_INVALID_PARAM = _cls("nixlInvalidParamError")
_NOT_FOUND = _cls("nixlNotFoundError")
_NOT_ALLOWED = _cls("nixlNotAllowedError")
_CANCELLED = _cls("nixlCancelledError")
_MISMATCH = _cls("nixlMismatchError")
_NOT_SUPPORTED = _cls("nixlNotSupportedError")
_NOT_POSTED = _cls("nixlNotPostedError")
_REPOST_ACTIVE = _cls("nixlRepostActiveError")


def map_nixl_error(exc: BaseException, *, op: str, peer: str = "") -> KvxferdError:
    """Return the kvxferd error for NIXL exception ``exc`` raised by ``op`` (towards ``peer``)."""
    if isinstance(exc, KvxferdError):
        return exc
    who = f" (peer {peer!r})" if peer else ""
    detail = f"{op}{who}: {type(exc).__name__}: {exc}"
    if isinstance(exc, _REMOTE_DISCONNECT):
        return PeerUnavailable(
            f"peer disconnected during {detail}",
            fix="the peer process died or its path broke; re-handshake (remove and re-add its "
            "new metadata) before retrying",
        )
    if isinstance(exc, _CANCELLED):
        return Cancelled(
            f"cancelled: {detail}",
            fix="the transfer was cancelled locally; retry it if still wanted",
        )
    if isinstance(exc, _NOT_FOUND):
        return InvalidRequest(
            f"unknown agent or unregistered memory in {detail}",
            fix="handshake with the peer first, and keep every descriptor inside a region "
            "registered on its side (re-handshake after re-registration)",
        )
    if isinstance(exc, _INVALID_PARAM | _MISMATCH | _NOT_SUPPORTED):
        return InvalidRequest(
            f"NIXL rejected the arguments of {detail}",
            fix="check memory types, descriptor counts (local and remote must match) and lengths",
        )
    if isinstance(exc, _NOT_ALLOWED | _NOT_POSTED | _REPOST_ACTIVE):
        return TransportError(
            f"NIXL refused {detail}",
            fix="a remote agent with this name is already loaded (remove it first) or the "
            "handle is in the wrong state; do not repost an active transfer",
        )
    if isinstance(exc, TypeError):
        return InvalidRequest(
            f"NIXL got malformed input in {detail}",
            fix="pass N x 3 int64 (addr, len, dev) arrays and a valid memory type",
        )
    return TransportError(
        f"NIXL failed in {detail}",
        fix="check the UCX transports (UCX_TLS, UCX_LOG_LEVEL=info) and both daemons' logs",
    )
