"""transfer.mode in the handshake: both sides must agree, and the refusal says what to change."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.errors import IncompatiblePeer, InvalidRequest, SpecError
from kvxferd.layout import preset
from kvxferd.peers import TRANSFER_MODES, PeerInfo, check_compatible, require_compatible
from kvxferd.v1 import peer_pb2
from kvxferd.wire.codec import mode_from_proto, mode_to_proto

SPECS = {
    "dense": preset("dense:num_blocks=8"),
    "hybrid": preset("hybrid:num_blocks=8"),
}


def info(mode: str, spec: str = "dense", *, name: str = "") -> PeerInfo:
    return PeerInfo(
        spec=SPECS[spec], tp_rank=0, tp_size=1, prefix_caching=False, transfer_mode=mode, name=name
    )


@given(
    local=st.sampled_from(TRANSFER_MODES),
    remote=st.sampled_from(TRANSFER_MODES),
    spec=st.sampled_from(sorted(SPECS)),
)
def test_modes_must_match_and_the_refusal_is_symmetric(local: str, remote: str, spec: str) -> None:
    ab = check_compatible(info(local, spec), info(remote, spec))
    ba = check_compatible(info(remote, spec), info(local, spec))
    assert ab.compatible == ba.compatible == (local == remote)
    if local != remote:
        (m,) = ab.mismatches
        assert m.what == "transfer mode (transfer.mode)"
        assert (m.local, m.remote) == (repr(local), repr(remote))
        # Which side to change, named by its mode (right whichever side reports it).
        assert f"set transfer.mode = {remote!r} on the daemon that runs {local!r}" in m.fix
        assert f"or {local!r} on the one that runs {remote!r}" in m.fix


def test_a_mismatch_is_refused_naming_the_peer() -> None:
    with pytest.raises(IncompatiblePeer) as ei:
        require_compatible(info("pull"), info("push", name="127.0.0.1:7"))
    assert "transfer mode" in str(ei.value)
    assert "127.0.0.1:7" in str(ei.value)


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="unknown transfer mode 'write'"):
        info("write")


def test_wire_mode_round_trips_and_unset_means_pull() -> None:
    for mode in TRANSFER_MODES:
        assert mode_from_proto(mode_to_proto(mode)) == mode
    assert mode_from_proto(peer_pb2.TRANSFER_MODE_UNSPECIFIED) == "pull"  # an older peer
    with pytest.raises(SpecError, match="transfer mode value 7"):
        mode_from_proto(7)
