"""PeerDirectory.usable, the pull's fast path to its peer: a link is handed over only while it
is handshaken and READY (else the caller awaits ready(), which handshakes or refuses), only
for an address the allow list let through, and it counts as a use for the LRU eviction."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from kvxferd.daemon.handshake import RemoteDescription, SelfDescription
from kvxferd.daemon.peers import LinkState, PeerDirectory
from kvxferd.errors import PermissionDenied


def _directory() -> PeerDirectory:
    return PeerDirectory(
        lambda: cast(SelfDescription, None),
        lambda remote: None,
        transport_factory=lambda address: cast(Any, object()),
        metadata=(),
        timeout_s=1.0,
        allow=lambda address: address.startswith("10."),
    )


def test_only_a_ready_link_is_usable_now() -> None:
    d = _directory()
    assert d.usable("10.0.0.1:7000") is None  # never handshaken: ready() must run
    link = d._link("10.0.0.1:7000")
    assert d.usable("10.0.0.1:7000") is None  # NEW
    link.state, link.remote = LinkState.READY, cast(RemoteDescription, object())
    link.last_used = 0.0
    assert d.usable("10.0.0.1:7000") is link and link.last_used > 0
    for state in (LinkState.STALE, LinkState.UNREACHABLE, LinkState.REFUSED):
        link.state = state
        assert d.usable("10.0.0.1:7000") is None


def test_a_disallowed_address_is_never_usable_and_ready_refuses_it() -> None:
    d = _directory()
    assert d.usable("192.168.0.1:7000") is None
    with pytest.raises(PermissionDenied, match=r"peers\.allow"):
        asyncio.run(d.ready("192.168.0.1:7000"))
    assert d.links() == []
