"""The wire floor: one error table both ways, and the typed Peer client over a fake transport."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxferd import errors as e
from kvxferd.v1 import peer_pb2
from kvxferd.wire.errors import STATUS_TABLE, error_from_rpc, status_for, trailer_for
from kvxferd.wire.peer_client import SESSION_METADATA, FakeTransport, PeerClient

CLASSES = sorted(
    {
        c
        for c in vars(e).values()
        if isinstance(c, type) and issubclass(c, e.KvxferdError) and c is not e.KvxferdError
    },
    key=lambda c: c.__name__,
)


def _make(cls: type[e.KvxferdError], field: str, fix: str) -> e.KvxferdError:
    if cls is e.IncompatiblePeer:
        return e.IncompatiblePeer([e.Mismatch("tp_size", "1", "2", fix or "match TP")])
    return cls("what went wrong", field=field, fix=fix)


def test_every_error_class_has_a_status_code() -> None:
    listed = {cls for cls, _ in STATUS_TABLE}
    assert set(CLASSES) <= listed | {c for c in CLASSES if any(issubclass(c, x) for x in listed)}
    assert status_for(RuntimeError("bug")).name == "INTERNAL"


@given(st.sampled_from(CLASSES), st.text(max_size=20), st.text(max_size=20))
def test_errors_cross_the_wire_as_themselves(
    cls: type[e.KvxferdError], field: str, fix: str
) -> None:
    """What a server raises is what the client gets: class, field and fix (and every
    mismatch of a refused handshake)."""
    err = _make(cls, field, fix)

    async def handler(method: str, request: Any, md: Any) -> Any:
        raise err

    client = PeerClient("peer:1", FakeTransport(handler))
    with pytest.raises(e.KvxferdError) as ei:
        asyncio.run(client.confirm("r", "me", 10, 1.0))
    got = ei.value
    assert type(got) is cls
    if cls is e.IncompatiblePeer:
        assert isinstance(got, e.IncompatiblePeer) and got.mismatches == err.mismatches  # type: ignore[attr-defined]
    else:
        assert (got.field, got.fix) == (err.field, err.fix)
        assert "what went wrong" in got.message


def test_a_call_without_the_trailer_maps_by_status_code() -> None:
    class Bare(Exception):
        def code(self) -> Any:
            return status_for(e.NotFound("x"))

        def details(self) -> str:
            return "no such lease"

        def trailing_metadata(self) -> Any:
            return ()

    got = error_from_rpc(Bare(), "confirming", "peer:1")  # type: ignore[arg-type]
    assert isinstance(got, e.NotFound) and "no such lease" in got.message


def test_session_metadata_and_deadlines() -> None:
    seen: list[tuple[str, Any]] = []

    async def handler(method: str, request: Any, md: Any) -> Any:
        seen.append((method, dict(md)))
        if method == "Handshake":
            return peer_pb2.HandshakeResponse(session=b"\x01\x02")
        return peer_pb2.ConfirmLeaseResponse(ticket=7)

    transport = FakeTransport(handler)
    client = PeerClient("peer:1", transport, credentials=(("authorization", "Bearer t"),))

    async def go() -> None:
        resp = await client.handshake(1, b"d", b"p")
        client.session = resp.session.hex()
        assert (await client.confirm("r", "me", 10, 0.5)).ticket == 7
        with pytest.raises(e.DeadlineExceeded):
            await client.confirm("r", "me", 10, 0.0)  # no time left: not even sent

    asyncio.run(go())
    assert seen[0] == ("Handshake", {"authorization": "Bearer t"})
    assert seen[1] == ("ConfirmLease", {"authorization": "Bearer t", SESSION_METADATA: "0102"})
    assert len(transport.calls) == 2


def test_trailer_is_an_error_detail() -> None:
    [(key, value)] = trailer_for(e.LeaseRefused("gone", field="request_id", fix="hold again"))
    assert key == "kvxferd-error-bin" and isinstance(value, bytes)
