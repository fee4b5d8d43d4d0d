"""The notification wire format."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.errors import InvalidRequest
from kvxferd.transfer import notify


@given(
    st.text(min_size=1, max_size=200).filter(lambda s: 0 < len(s.encode()) <= 1024),
    st.integers(1, 2**64 - 1),
)
def test_round_trip(rid: str, ticket: int) -> None:
    note = notify.decode(notify.encode(rid, ticket))
    assert note.request_id == rid and note.kind is notify.NotifKind.READ_DONE
    assert note.ticket == ticket


def test_layout_is_fixed() -> None:
    assert notify.encode("r1", 5) == b"KVXN\x02\x01\x00\x02" + b"\x00" * 7 + b"\x05r1"


T = b"\x00" * 7 + b"\x05"


@pytest.mark.parametrize(
    "msg",
    [
        b"",
        b"hi",
        b"XXXX\x02\x01\x00\x02" + T + b"r1",
        b"KVXN\x01\x01\x00\x02" + T + b"r1",  # version 1 (no ticket) is not spoken any more
        b"KVXN\x02\x09\x00\x02" + T + b"r1",
        b"KVXN\x02\x01\x00\x03" + T + b"r1",
        b"KVXN\x02\x01\x00\x00" + T,
        b"KVXN\x02\x01\x00\x02" + T + b"\xff\xfe",
    ],
)
def test_malformed_is_rejected(msg: bytes) -> None:
    with pytest.raises(InvalidRequest):
        notify.decode(msg)


def test_bad_request_ids_and_tickets_are_rejected() -> None:
    with pytest.raises(InvalidRequest):
        notify.encode("", 1)
    with pytest.raises(InvalidRequest, match="1024"):
        notify.encode("x" * 1025, 1)
    with pytest.raises(InvalidRequest):
        notify.encode("r", 0)
