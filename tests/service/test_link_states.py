"""Every peer-link state has its ListPeers value (a state without one made ListPeers fail)."""

from __future__ import annotations

from kvxferd.daemon.peers import LinkState
from kvxferd.service.scheduler_service import LINK_STATES as _LINK
from kvxferd.v1 import scheduler_pb2


def test_every_link_state_is_listed() -> None:
    assert set(_LINK) == set(LinkState)
    assert _LINK[LinkState.STALE] == scheduler_pb2.HANDSHAKE_STATE_STALE
