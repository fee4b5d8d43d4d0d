"""The one exception tree of kvxferd.

Every error the daemon raises on purpose is a :class:`KvxferdError`. Each says what was wrong
(``str(err)``), which input it concerns (``field``, a dotted path such as
``groups[1].remote_block_ids[3]`` or ``""``) and how to fix it (``fix``). The service layer maps
each class to one gRPC status code in one table (``kvxferd.wire.errors``); nothing else
decides status codes.

::

    KvxferdError
    ├── ConfigError              bad configuration file, flag or environment value
    ├── SpecError                a KV cache spec (file, tensors, preset) is malformed
    ├── InvalidRequest           malformed or out-of-range request input
    │   └── BlockRangeError      a block ID is negative, duplicated or past the registered count
    ├── IncompatiblePeer         handshake refused; ``mismatches`` lists every reason
    ├── PeerUnavailable          unknown, unreachable or dead peer
    ├── DeadlineExceeded         a transfer or call missed its deadline
    ├── ResourceExhausted        in-flight queue or staging space is full
    ├── NotFound                 unknown transfer, request or lease
    ├── AlreadyExists            duplicate transfer or request ID
    ├── LeaseRefused             the lease expired or was released before it was confirmed
    ├── Unauthenticated          missing or wrong token / client certificate
    ├── Cancelled                the transfer was cancelled
    ├── TransportError           NIXL/UCX reported a failure moving bytes
    └── EngineDetached           the engine detached or died: no pool is registered now
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class KvxferdError(Exception):
    """Base class: a message, the input field it concerns and a fix."""

    def __init__(self, message: str, *, field: str = "", fix: str = "") -> None:
        self.message = message
        self.field = field
        self.fix = fix
        super().__init__(self.describe())

    def describe(self) -> str:
        parts = []
        if self.field:
            parts.append(f"{self.field}: ")
        parts.append(self.message)
        if self.fix:
            parts.append(f" (fix: {self.fix})")
        return "".join(parts)


class ConfigError(KvxferdError):
    """A configuration value is missing, malformed or inconsistent."""


class SpecError(KvxferdError):
    """A KV cache spec is malformed or describes memory that is not blocks-first."""


class InvalidRequest(KvxferdError):
    """A request's input is malformed (wrong group count, too many IDs, bad option)."""


class BlockRangeError(InvalidRequest):
    """A block ID is negative, duplicated, or not below the registered number of blocks."""


@dataclass(frozen=True)
class Mismatch:
    """One reason two peers are incompatible, with what to change."""

    what: str
    local: str
    remote: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what} is local {self.local}, remote {self.remote} (fix: {self.fix})"


class IncompatiblePeer(KvxferdError):
    """The handshake was refused; every mismatch found is listed, not just the first."""

    def __init__(self, mismatches: Sequence[Mismatch], *, peer: str = "", detail: str = "") -> None:
        """``detail``: the peer's own refusal text, when the peer refused (not us)."""
        self.mismatches = tuple(mismatches)
        self.peer = peer
        who = f" with {peer}" if peer else ""
        if detail:
            text = (
                f"handshake{who} refused by the peer (in its words 'local' is the peer and"
                f" 'remote' is this daemon): {detail}"
            )
        else:
            lines = "; ".join(str(m) for m in self.mismatches)
            text = f"handshake{who} refused, {len(self.mismatches)} mismatch(es): {lines}"
        # Each mismatch carries its own fix; there is no single one for the whole refusal.
        super().__init__(text)


class PeerUnavailable(KvxferdError):
    """The peer is unknown, unreachable, or died; its transfers fail."""


class DeadlineExceeded(KvxferdError):
    """A transfer (or a call) did not finish before its deadline."""


class ResourceExhausted(KvxferdError):
    """A bounded queue (in-flight transfers, bytes per peer, staging) is full."""


class NotFound(KvxferdError):
    """The named transfer, request or lease does not exist (or no longer does)."""


class AlreadyExists(KvxferdError):
    """The ID is already in use."""


class LeaseRefused(KvxferdError):
    """The owner no longer holds the request's blocks under a lease; nothing may be read."""


class Unauthenticated(KvxferdError):
    """The caller did not present the configured token or certificate."""


class UnknownSession(Unauthenticated):
    """The caller's peer session is not (or no longer) known: it must handshake again."""


class PermissionDenied(KvxferdError):
    """The caller is known but may not do this (not a reader of the lease, address not allowed)."""


class Cancelled(KvxferdError):
    """The transfer was cancelled by a caller or by shutdown."""


class TransportError(KvxferdError):
    """NIXL or UCX reported a failure while moving bytes."""


class EngineDetached(KvxferdError):
    """No KV pool is attached: the engine detached or its process died; a re-attach is awaited.

    Peers get UNAVAILABLE (retry after the engine re-attaches; a request held before the
    detach is gone and must be prefilled again)."""


class SlowTransport(KvxferdError):
    """A VRAM-to-VRAM pull would run over a transport at TCP speed (UCX active messages), and
    ``transfer.allow_slow_transport`` is off: refused with the transport, its measured rate and
    the fix, rather than moving GPU memory 3,000 times slower than the link (docs/nixl.md §7)."""


class StateConflict(KvxferdError):
    """The call is well formed but the daemon's state does not allow it now: an engine session
    for an attachment that is not the current one, a Detach while requests are still held.
    Answered FAILED_PRECONDITION (engine.proto): change the state first, then call again."""
