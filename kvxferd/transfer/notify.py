"""The transfer-done notification: a fixed binary header plus the request ID (pure).

Layout (network byte order), version 1::

    offset  size  field
    0       4     magic b"KVXN"
    4       1     version (1)
    5       1     kind (1 = READ_DONE: the sender finished reading the request's blocks)
    6       2     request ID length n (bytes, <= 1024)
    8       n     request ID, UTF-8

No pickle, no string splitting; anything else is rejected with :class:`InvalidRequest`. If the
wire contract in ``proto/`` later defines this message, :func:`encode`/:func:`decode` are the
only functions to swap.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from kvxferd.errors import InvalidRequest

MAGIC = b"KVXN"
VERSION = 1
MAX_REQUEST_ID_BYTES = 1024
_HEADER = struct.Struct("!4sBBH")


class NotifKind(enum.IntEnum):
    READ_DONE = 1


@dataclass(frozen=True)
class Notification:
    kind: NotifKind
    request_id: str


def encode(request_id: str, kind: NotifKind = NotifKind.READ_DONE) -> bytes:
    raw = request_id.encode("utf-8")
    if not raw or len(raw) > MAX_REQUEST_ID_BYTES:
        raise InvalidRequest(
            f"request ID must be 1..{MAX_REQUEST_ID_BYTES} UTF-8 bytes, got {len(raw)}",
            field="request_id",
        )
    return _HEADER.pack(MAGIC, VERSION, int(kind), len(raw)) + raw


def decode(msg: bytes) -> Notification:
    if len(msg) < _HEADER.size:
        raise InvalidRequest(f"notification of {len(msg)} bytes is shorter than its header")
    magic, version, kind, n = _HEADER.unpack_from(msg)
    if magic != MAGIC:
        raise InvalidRequest(
            f"notification magic {magic!r} is not {MAGIC!r}",
            fix="the sender is not a kvxferd daemon",
        )
    if version != VERSION:
        raise InvalidRequest(
            f"notification version {version}, this daemon speaks {VERSION}",
            fix="run the same kvxferd version on both peers",
        )
    if len(msg) != _HEADER.size + n or n == 0:
        raise InvalidRequest(f"notification length {len(msg)} does not match its header")
    try:
        knd = NotifKind(kind)
    except ValueError:
        raise InvalidRequest(f"unknown notification kind {kind}") from None
    try:
        rid = msg[_HEADER.size :].decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("notification request ID is not UTF-8") from None
    return Notification(knd, rid)
