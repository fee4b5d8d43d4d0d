"""The transfer-done notification: a fixed binary header, the reader's ticket, the request ID.

Layout (network byte order), version 2::

    offset  size  field
    0       4     magic b"KVXN"
    4       1     version (2)
    5       1     kind (1 = READ_DONE: the sender finished reading the request's blocks;
                  2 = WRITE_DONE: the sender finished writing a push into the receiver's blocks)
    6       2     request ID length n (bytes, 1..1024)
    8       8     ticket: READ_DONE: the reader's share of the lease, as ConfirmLease returned
                  it; WRITE_DONE: the PushRequest.notif_ticket the receiver chose
    16      n     request ID, UTF-8

The ticket is what makes a notification count: the owner ends only the share whose ticket it
carries (:meth:`kvxferd.transfer.leases.LeaseTable.notified`), so a peer that never confirmed
the lease cannot end another reader's share. No pickle, no string splitting; anything else is
rejected with :class:`InvalidRequest`. A WRITE_DONE counts only on the daemon that asked for
that push, with the ticket it chose and from the agent it asked (push mode, docs/nixl.md).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from kvxferd.errors import InvalidRequest

MAGIC = b"KVXN"
VERSION = 2
MAX_REQUEST_ID_BYTES = 1024
_HEADER = struct.Struct("!4sBBHQ")


class NotifKind(enum.IntEnum):
    READ_DONE = 1
    WRITE_DONE = 2


@dataclass(frozen=True)
class Notification:
    kind: NotifKind
    request_id: str
    ticket: int


def check_request_id(request_id: str, field: str = "request_id") -> bytes:
    """The request ID as a notification carries it; refused when it cannot carry it."""
    raw = request_id.encode("utf-8", errors="surrogatepass")
    if not raw or len(raw) > MAX_REQUEST_ID_BYTES:
        raise InvalidRequest(
            f"request ID must be 1..{MAX_REQUEST_ID_BYTES} UTF-8 bytes, got {len(raw)}",
            field=field,
            fix=f"use request IDs of at most {MAX_REQUEST_ID_BYTES} bytes",
        )
    return raw


def encode(request_id: str, ticket: int, kind: NotifKind = NotifKind.READ_DONE) -> bytes:
    raw = check_request_id(request_id)
    if not 0 < ticket < 1 << 64:
        raise InvalidRequest(f"notification ticket {ticket} is not a ConfirmLease ticket")
    return _HEADER.pack(MAGIC, VERSION, int(kind), len(raw), ticket) + raw


def decode(msg: bytes) -> Notification:
    if len(msg) < _HEADER.size:
        raise InvalidRequest(f"notification of {len(msg)} bytes is shorter than its header")
    magic, version, kind, n, ticket = _HEADER.unpack_from(msg)
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
    return Notification(knd, rid, ticket)
