"""PeerClient.push: the call lasts as long as the pull may (not the per-call cap), carries the
session, and an owner's refusal reaches the reader as the same error class."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvxferd.errors import LeaseRefused
from kvxferd.v1 import peer_pb2
from kvxferd.wire.peer_client import SESSION_METADATA, FakeTransport, Metadata, PeerClient


class Recorder:
    """A transport that records each call's timeout and metadata, then answers via ``inner``."""

    def __init__(self, inner: FakeTransport) -> None:
        self.inner = inner
        self.seen: list[tuple[str, float, Metadata]] = []

    async def __call__(
        self, method: str, request: Any, *, timeout: float, metadata: Metadata
    ) -> Any:
        self.seen.append((method, timeout, metadata))
        return await self.inner(method, request, timeout=timeout, metadata=metadata)

    async def close(self) -> None:
        return None


def _client(handler: Any) -> tuple[PeerClient, Recorder]:
    rec = Recorder(FakeTransport(handler))
    client = PeerClient("prefill:1", rec, max_timeout_s=5.0)
    client.session = "ab" * 16
    return client, rec


def test_push_gets_the_whole_time_left_and_confirm_stays_capped() -> None:
    async def answer(method: str, request: Any, metadata: Metadata) -> Any:
        if method == "Push":
            return peer_pb2.PushResponse(nbytes=4096, descriptors=1)
        return peer_pb2.ConfirmLeaseResponse(ticket=3)

    async def go() -> None:
        client, rec = _client(answer)
        resp = await client.push(peer_pb2.PushRequest(request_id="r", notif_ticket=1), 42.0)
        assert resp.nbytes == 4096
        await client.confirm("r", "me", 1000, 42.0)
        (push, push_timeout, md), (confirm, confirm_timeout, _) = rec.seen
        assert (push, push_timeout) == ("Push", 42.0)
        assert (confirm, confirm_timeout) == ("ConfirmLease", 5.0)
        assert (SESSION_METADATA, "ab" * 16) in md

    asyncio.run(go())


def test_an_owner_refusal_arrives_as_itself() -> None:
    async def refuse(method: str, request: Any, metadata: Metadata) -> Any:
        raise LeaseRefused("request 'r' is no longer held", field="request_id", fix="re-run")

    async def go() -> None:
        client, _ = _client(refuse)
        with pytest.raises(LeaseRefused, match="no longer held") as ei:
            await client.push(peer_pb2.PushRequest(request_id="r", notif_ticket=1), 3.0)
        assert ei.value.field == "request_id"
        assert "peer prefill:1 refused pushing 'r'" in str(ei.value)
        assert ei.value.fix == "re-run"

    asyncio.run(go())
