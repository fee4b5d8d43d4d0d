"""Hostile Push calls against a real push-mode prefill daemon: each is refused with its own
status before anything is loaded or written.

The caller is a raw peer (tests/service/raw_peer.py) whose handshake advertises push mode, a
real spec and registrations of 4096 bytes at made-up addresses with NIXL metadata that NIXL
cannot load: a Push that got as far as loading it or posting a WRITE would fail otherwise
(UNAVAILABLE), so each expected refusal also shows nothing was loaded or written.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import grpc
from grpc import aio

from kvxferd.v1 import peer_pb2, peer_pb2_grpc
from kvxferd.wire.codec import group_ids_to_proto
from tests.push.client import Client
from tests.service.conftest import Daemons
from tests.service.raw_peer import RawPeer, describe


async def raw_peer(address: str, mode: str, agent: str) -> RawPeer:
    me = describe("dense:num_blocks=64", agent, f"{agent}-instance")
    me = dataclasses.replace(me, info=dataclasses.replace(me.info, transfer_mode=mode))
    stub = peer_pb2_grpc.PeerStub(aio.insecure_channel(address))
    version, digest, payload = me.envelope()
    resp = await stub.Handshake(
        peer_pb2.HandshakeRequest(protocol_version=version, compat_digest=digest, payload=payload),
        timeout=10,
    )
    return RawPeer(stub, resp.session.hex(), me.instance_id)


async def call_push(
    peer: RawPeer,
    rid: str,
    remote: Sequence[int],
    local: Sequence[int],
    *,
    ticket: int = 7,
    timeout_ms: int = 2_000,
) -> tuple[grpc.StatusCode, str]:
    """The status of a Push (OK when it was answered) and its details."""
    try:
        await peer.stub.Push(
            peer_pb2.PushRequest(
                request_id=rid,
                remote_block_ids=group_ids_to_proto([list(remote)]),
                local_block_ids=group_ids_to_proto([list(local)]),
                notif_ticket=ticket,
                write_timeout_ms=timeout_ms,
            ),
            metadata=peer.md,
            timeout=10,
        )
    except aio.AioRpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_hostile_pushes_are_refused_before_anything_is_written(push: Daemons) -> None:
    async def go() -> None:
        prefill, c = push["prefill"], Client(push["prefill"], push["decode"])
        peer = await raw_peer(prefill.grpc, "push", "hostile-writer")
        before = [await c.digests(c.prefill, 0, [40, 41, 42])]

        async def expect(code: grpc.StatusCode, text: str, *args: object, **kw: object) -> None:
            got, details = await call_push(peer, *args, **kw)  # type: ignore[arg-type]
            assert got == code, (args, kw, got, details)
            assert text in details, details

        # A request never held here.
        await expect(grpc.StatusCode.NOT_FOUND, "not held here", "h-unknown", [1], [1])
        # Held, but the caller never confirmed its share.
        await c.hold("h-unconfirmed", [[40]])
        await expect(grpc.StatusCode.PERMISSION_DENIED, "not confirmed", "h-unconfirmed", [40], [0])
        # Held and confirmed, but it names blocks the request does not hold.
        await c.hold("h-held", [[41, 42]])
        await peer.confirm("h-held")
        await expect(
            grpc.StatusCode.FAILED_PRECONDITION, "not held under", "h-held", [41, 43], [0, 1]
        )
        # Local IDs outside the caller's pool.
        await expect(grpc.StatusCode.INVALID_ARGUMENT, "block", "h-held", [41, 42], [0, 64])
        # Inside the pool, but outside the 4096 bytes the caller registered.
        await expect(
            grpc.StatusCode.INVALID_ARGUMENT,
            "outside the caller's registered",
            "h-held",
            [41, 42],
            [0, 1],
        )
        # No ticket, or no time to write.
        await expect(
            grpc.StatusCode.INVALID_ARGUMENT, "notif_ticket", "h-held", [41], [0], ticket=0
        )
        await expect(
            grpc.StatusCode.INVALID_ARGUMENT, "write_timeout_ms", "h-held", [41], [0], timeout_ms=0
        )
        # An expired lease.
        await c.hold("h-expired", [[43]], ttl_ms=200)
        await asyncio.sleep(0.6)
        await expect(grpc.StatusCode.FAILED_PRECONDITION, "no longer held", "h-expired", [43], [0])
        # The prefill's own blocks were only ever read.
        assert [await c.digests(c.prefill, 0, [40, 41, 42])] == before

    run(go())


def test_a_pull_mode_daemon_answers_no_push(push: Daemons) -> None:
    async def go() -> None:
        peer = await raw_peer(push["pull-decode"].grpc, "pull", "pull-mode-caller")
        got, details = await call_push(peer, "anything", [1], [1])
        assert got == grpc.StatusCode.FAILED_PRECONDITION
        assert "only answers READs" in details

    run(go())


def test_an_unknown_session_cannot_push(push: Daemons) -> None:
    async def go() -> None:
        peer = await raw_peer(push["prefill"].grpc, "push", "no-session")
        peer.session = "00" * 16
        got, _ = await call_push(peer, "anything", [1], [1])
        assert got == grpc.StatusCode.UNAUTHENTICATED

    run(go())
