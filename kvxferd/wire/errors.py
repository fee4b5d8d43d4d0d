"""The one table from kvxferd errors to gRPC status codes, both ways.

Servers never pick status codes themselves: they raise :mod:`kvxferd.errors` exceptions,
:func:`status_for` decides the code and :func:`trailer_for` encodes the error as a
``common.proto`` ``ErrorDetail`` in the ``kvxferd-error-bin`` trailing metadata. Clients turn a
failed call back into the same exception class with :func:`error_from_rpc`, from the trailer
when the server sent one and from the status code otherwise. Anything that is not a
``KvxferdError`` is a bug and becomes ``INTERNAL`` with a message that says so.
"""

from __future__ import annotations

import re
from typing import Any

import grpc

from kvxferd import errors as e
from kvxferd.v1 import common_pb2

ERROR_TRAILER = "kvxferd-error-bin"

STATUS_TABLE: tuple[tuple[type[e.KvxferdError], grpc.StatusCode], ...] = (
    # Most specific first: BlockRangeError is an InvalidRequest, UnknownSession Unauthenticated.
    (e.BlockRangeError, grpc.StatusCode.INVALID_ARGUMENT),
    (e.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (e.SpecError, grpc.StatusCode.INVALID_ARGUMENT),
    (e.ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (e.IncompatiblePeer, grpc.StatusCode.FAILED_PRECONDITION),
    (e.SlowTransport, grpc.StatusCode.FAILED_PRECONDITION),
    (e.StateConflict, grpc.StatusCode.FAILED_PRECONDITION),
    (e.LeaseRefused, grpc.StatusCode.FAILED_PRECONDITION),
    (e.PeerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (e.TransportError, grpc.StatusCode.UNAVAILABLE),
    (e.EngineDetached, grpc.StatusCode.UNAVAILABLE),
    (e.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (e.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.NotFound, grpc.StatusCode.NOT_FOUND),
    (e.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (e.UnknownSession, grpc.StatusCode.UNAUTHENTICATED),
    (e.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (e.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (e.Cancelled, grpc.StatusCode.CANCELLED),
)

# For calls that carry no trailer (another server, a proxy, gRPC itself): the class a code
# most likely means.
_BY_CODE: dict[grpc.StatusCode, type[e.KvxferdError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: e.InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: e.LeaseRefused,
    grpc.StatusCode.NOT_FOUND: e.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: e.AlreadyExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: e.ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: e.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: e.PermissionDenied,
    grpc.StatusCode.DEADLINE_EXCEEDED: e.DeadlineExceeded,
    grpc.StatusCode.CANCELLED: e.Cancelled,
}


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


def _kind_name(cls: type[e.KvxferdError]) -> str:
    return "ERROR_KIND_" + _snake(cls.__name__.removesuffix("Error"))


_CLASSES: tuple[type[e.KvxferdError], ...] = tuple(
    c
    for c in vars(e).values()
    if isinstance(c, type) and issubclass(c, e.KvxferdError) and c is not e.KvxferdError
)
_KINDS: dict[str, int] = dict(common_pb2.ErrorKind.items())
# A class without an ErrorKind (tests/proto/test_contract.py forbids that) travels as
# UNSPECIFIED and is rebuilt from its status code.
_KIND_OF: dict[type[e.KvxferdError], int] = {
    c: _KINDS[_kind_name(c)] for c in _CLASSES if _kind_name(c) in _KINDS
}
_CLASS_OF: dict[int, type[e.KvxferdError]] = {v: k for k, v in _KIND_OF.items()}


def status_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in STATUS_TABLE:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


# gRPC carries a status message in a header, percent-encoding every byte outside printable
# ASCII (up to 3x), and refuses a call whose metadata exceeds 8 KiB in all: a message that
# repeats a caller's long input (an ID of 70,000 characters) would fail the call with
# RESOURCE_EXHAUSTED instead of its own status. Messages are cut to this many UTF-8 bytes.
MESSAGE_LIMIT = 1800


def clip(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` cut to at most ``limit`` bytes of UTF-8 (on a character boundary), saying how
    many bytes were cut; unchanged when it fits."""
    raw = text.encode()
    if len(raw) <= limit:
        return text
    kept = raw[: limit - 32].decode(errors="ignore")
    return f"{kept}... ({len(raw) - len(kept.encode())} bytes cut)"


def message_for(exc: BaseException) -> str:
    if isinstance(exc, e.KvxferdError):
        text = str(exc)
    else:
        text = (
            f"internal error ({type(exc).__name__}: {exc}); this is a kvxferd bug, please report it"
        )
    return clip(text)


# The status message already carries the whole text; the trailer carries the structure and
# stays small, since gRPC refuses metadata over 8 KiB in all (message and trailer together).
TRAILER_BUDGET = 2048
_TEXT_LIMIT = 512


def _short(text: str) -> str:
    return clip(text, _TEXT_LIMIT)


def kind_of(err: e.KvxferdError) -> common_pb2.ErrorKind.ValueType:
    """``err``'s ErrorKind (UNSPECIFIED only for a class the proto does not know)."""
    return _KIND_OF.get(type(err), common_pb2.ERROR_KIND_UNSPECIFIED)  # type: ignore[return-value]


def detail_for(err: e.KvxferdError) -> common_pb2.ErrorDetail:
    detail = common_pb2.ErrorDetail(
        kind=kind_of(err),
        message=_short(err.message),
        field=_short(err.field),
        fix=_short(err.fix),
    )
    if isinstance(err, e.IncompatiblePeer):
        for m in err.mismatches:
            detail.mismatches.add(
                what=_short(m.what),
                local=_short(m.local),
                remote=_short(m.remote),
                fix=_short(m.fix),
            )
            if detail.ByteSize() > TRAILER_BUDGET:
                del detail.mismatches[-1]  # the rest are in the status message
                break
    return detail


def trailer_for(err: e.KvxferdError) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata a server sends with ``err``'s status."""
    return ((ERROR_TRAILER, detail_for(err).SerializeToString()),)


def detail_from_rpc(exc: grpc.RpcError) -> common_pb2.ErrorDetail | None:
    trailer: Any = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else ()
    for item in trailer or ():
        key, value = tuple(item)
        if key == ERROR_TRAILER and isinstance(value, bytes):
            try:
                return common_pb2.ErrorDetail.FromString(value)
            except Exception:  # protobuf's DecodeError: ignore a foreign trailer
                return None
    return None


def class_of_detail(detail: common_pb2.ErrorDetail) -> type[e.KvxferdError] | None:
    """The kvxferd error class an ErrorDetail names (None for UNSPECIFIED or an unknown kind)."""
    return _CLASS_OF.get(detail.kind)


def error_from_rpc(exc: grpc.RpcError, what: str, address: str) -> e.KvxferdError:
    """The kvxferd error behind a failed call to ``address`` (doing ``what``)."""
    call: Any = exc
    code: grpc.StatusCode = call.code()
    text: str = call.details() or ""
    detail = detail_from_rpc(exc)
    if detail is not None and detail.kind in _CLASS_OF:
        cls = _CLASS_OF[detail.kind]
        message = f"peer {address} refused {what}: {detail.message}"
        if cls is e.IncompatiblePeer:
            mismatches = [e.Mismatch(m.what, m.local, m.remote, m.fix) for m in detail.mismatches]
            return e.IncompatiblePeer(mismatches, peer=address, detail=text)
        return cls(message, field=detail.field, fix=detail.fix)
    if code == grpc.StatusCode.FAILED_PRECONDITION and what == "handshake":
        return e.IncompatiblePeer([], peer=address, detail=text)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:  # the call ran out of time: no refusal
        return e.DeadlineExceeded(
            f"peer {address} did not answer {what} in time ({code.name}: {text})",
            fix="check the peer daemon's load and health, or raise the pull's deadline_ms",
        )
    by_code = _BY_CODE.get(code)
    if by_code is not None:
        return by_code(f"peer {address} refused {what}: {code.name}: {text}")
    return e.PeerUnavailable(
        f"{what} with {address} failed: {code.name}: {text}",
        field="peer_address",
        fix="check that the peer daemon runs and is reachable at that address",
    )
