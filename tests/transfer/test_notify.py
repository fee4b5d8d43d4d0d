"""The notification wire format."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.errors import InvalidRequest
from kvxferd.transfer import notify


@given(st.text(min_size=1, max_size=200).filter(lambda s: 0 < len(s.encode()) <= 1024))
def test_round_trip(rid: str) -> None:
    note = notify.decode(notify.encode(rid))
    assert note.request_id == rid and note.kind is notify.NotifKind.READ_DONE


def test_layout_is_fixed() -> None:
    assert notify.encode("r1") == b"KVXN\x01\x01\x00\x02r1"


@pytest.mark.parametrize(
    "msg",
    [
        b"",
        b"hi",
        b"XXXX\x01\x01\x00\x02r1",
        b"KVXN\x02\x01\x00\x02r1",
        b"KVXN\x01\x09\x00\x02r1",
        b"KVXN\x01\x01\x00\x03r1",
        b"KVXN\x01\x01\x00\x00",
        b"KVXN\x01\x01\x00\x02\xff\xfe",
    ],
)
def test_malformed_is_rejected(msg: bytes) -> None:
    with pytest.raises(InvalidRequest):
        notify.decode(msg)


def test_bad_request_ids_are_rejected() -> None:
    with pytest.raises(InvalidRequest):
        notify.encode("")
    with pytest.raises(InvalidRequest):
        notify.encode("x" * 1025)
