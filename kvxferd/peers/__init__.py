"""Peers: the handshake's compatibility contract.

Owns: the protocol version (:mod:`~kvxferd.peers.version`), the compatibility digest a
handshake compares before decoding the rest, and the pure compatibility check
(:mod:`~kvxferd.peers.compat`) that lists every mismatch between two peers, each with its fix,
and raises :class:`~kvxferd.errors.IncompatiblePeer`. Pure: numbers and specs in, a report out.
Must not import nixl or grpc (nor anything that does I/O); transports use this package, never
the reverse.
"""

from kvxferd.peers.compat import (
    TRANSFER_MODES,
    CompatReport,
    PeerInfo,
    check_compatible,
    require_compatible,
)
from kvxferd.peers.version import PROTOCOL_VERSION, compat_digest

__all__ = [
    "PROTOCOL_VERSION",
    "TRANSFER_MODES",
    "CompatReport",
    "PeerInfo",
    "check_compatible",
    "compat_digest",
    "require_compatible",
]
