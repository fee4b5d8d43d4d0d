"""Bad input gets the right status code and a message naming the field; the daemon survives."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
from grpc import aio

from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from kvxferd.wire.codec import group_ids_to_proto
from tests.service.conftest import Daemon, launch
from tests.service.test_service_pull import Client

C = grpc.StatusCode


@pytest.fixture(scope="module")
def extra(
    tmp_path_factory: pytest.TempPathFactory, pair: tuple[Daemon, Daemon]
) -> Iterator[tuple[Daemon, Daemon]]:
    """A decode daemon with an incompatible spec, and one that requires a token."""
    ds = launch(
        tmp_path_factory.mktemp("extra"),
        DaemonOptions("mla", "mla:num_blocks=16,num_layers=4"),
        DaemonOptions("tok", "dense:num_blocks=16", token="s3cret"),
    )
    yield ds["mla"], ds["tok"]
    ds.stop()


def start_pull(
    target: str, held: engine_pb2.HoldResponse, **kw: object
) -> scheduler_pb2.StartPullResponse:
    async def go() -> scheduler_pb2.StartPullResponse:
        stub = scheduler_pb2_grpc.SchedulerStub(
            aio.insecure_channel(target, options=(("grpc.max_send_message_length", 64 << 20),))
        )
        return await stub.StartPull(
            scheduler_pb2.StartPullRequest(
                request_id=held.request_id,
                peer_address=held.peer_address,
                remote_block_ids=held.remote_block_ids,
                **kw,  # type: ignore[arg-type]
            )
        )

    return asyncio.run(go())


def held_for(pair: tuple[Daemon, Daemon], rid: str, ids: list[int]) -> engine_pb2.HoldResponse:
    async def go() -> engine_pb2.HoldResponse:
        return await Client(*pair).hold(rid, ids)

    return asyncio.run(go())


def expect(code: grpc.StatusCode, needle: str, fn: object) -> str:
    with pytest.raises(aio.AioRpcError) as ei:
        fn()  # type: ignore[operator]
    assert ei.value.code() == code, ei.value.details()
    details = ei.value.details() or ""
    assert needle in details, details
    return details


def ids(*groups: list[int]) -> object:
    return group_ids_to_proto([list(g) for g in groups])


@pytest.mark.parametrize(
    ("case", "local", "code", "needle"),
    [
        ("more local than remote", ids([1, 2, 3, 4]), C.INVALID_ARGUMENT, "local"),
        ("negative local ID", ids([-1]), C.INVALID_ARGUMENT, "local_block_ids"),
        ("local ID past the pool", ids([64]), C.INVALID_ARGUMENT, "local_block_ids"),
        ("duplicate local IDs", ids([5, 5]), C.INVALID_ARGUMENT, "duplicate"),
        ("group count", ids([1], [2]), C.INVALID_ARGUMENT, "groups"),
    ],
)
def test_bad_local_ids(
    pair: tuple[Daemon, Daemon], case: str, local: object, code: grpc.StatusCode, needle: str
) -> None:
    held = held_for(pair, f"bad-{case}", [1, 2])
    expect(code, needle, lambda: start_pull(pair[1].grpc, held, local_block_ids=local))


def test_bad_remote_ids_and_hold_inputs(pair: tuple[Daemon, Daemon]) -> None:
    fake = engine_pb2.HoldResponse(
        peer_address=pair[0].grpc, request_id="x", remote_block_ids=ids([10_000])
    )
    expect(
        C.INVALID_ARGUMENT,
        "remote_block_ids",
        lambda: start_pull(pair[1].grpc, fake, local_block_ids=ids([1])),
    )
    huge = engine_pb2.HoldResponse(
        peer_address=pair[0].grpc, request_id="x", remote_block_ids=ids(list(range(2_000_000)))
    )
    expect(
        C.INVALID_ARGUMENT,
        "remote_block_ids",
        lambda: start_pull(pair[1].grpc, huge, local_block_ids=ids([1])),
    )

    async def hold(rid: str, block_ids: object) -> None:
        stub = engine_pb2_grpc.EngineStub(aio.insecure_channel(f"unix:{pair[0].engine_socket}"))
        await stub.Hold(engine_pb2.HoldRequest(request_id=rid, block_ids=block_ids))  # type: ignore[arg-type]

    expect(C.INVALID_ARGUMENT, "block_ids", lambda: asyncio.run(hold("h1", ids([99]))))
    expect(C.INVALID_ARGUMENT, "block_ids.groups", lambda: asyncio.run(hold("h2", ids())))
    asyncio.run(hold("dup", ids([1])))
    expect(C.ALREADY_EXISTS, "request_id", lambda: asyncio.run(hold("dup", ids([2]))))


def test_unknown_peer_is_unavailable(pair: tuple[Daemon, Daemon]) -> None:
    nowhere = engine_pb2.HoldResponse(
        peer_address="127.0.0.1:1", request_id="x", remote_block_ids=ids([1])
    )
    expect(
        C.UNAVAILABLE,
        "127.0.0.1:1",
        lambda: start_pull(pair[1].grpc, nowhere, local_block_ids=ids([1])),
    )


def test_start_pull_is_idempotent_on_transfer_id(pair: tuple[Daemon, Daemon]) -> None:
    """scheduler.proto: an identical retry returns the existing transfer (created = false); the
    same ID for a different request is ALREADY_EXISTS."""
    held = held_for(pair, "dup-transfer", [3])
    first = start_pull(pair[1].grpc, held, local_block_ids=ids([3]), transfer_id="t-dup")
    assert first.created and first.status.transfer_id == "t-dup"
    again = start_pull(pair[1].grpc, held, local_block_ids=ids([3]), transfer_id="t-dup")
    assert not again.created and again.status.transfer_id == "t-dup"
    assert again.status.request_id == first.status.request_id
    expect(
        C.ALREADY_EXISTS,
        "transfer_id",
        lambda: start_pull(pair[1].grpc, held, local_block_ids=ids([4]), transfer_id="t-dup"),
    )


def test_incompatible_spec_lists_mismatches(
    pair: tuple[Daemon, Daemon], extra: tuple[Daemon, Daemon]
) -> None:
    mla, _ = extra
    held = held_for(pair, "to-mla", [1])
    details = expect(
        C.FAILED_PRECONDITION,
        "mismatch",
        lambda: start_pull(mla.grpc, held, local_block_ids=ids([1])),
    )
    assert "model" in details
    assert "fix:" in details


def test_token(pair: tuple[Daemon, Daemon], extra: tuple[Daemon, Daemon]) -> None:
    _, tok = extra

    async def peers(token: str | None) -> int:
        stub = scheduler_pb2_grpc.SchedulerStub(aio.insecure_channel(tok.grpc))
        md = (("authorization", f"Bearer {token}"),) if token else None
        resp = await stub.ListPeers(scheduler_pb2.ListPeersRequest(), metadata=md)
        return len(resp.peers)

    expect(C.UNAUTHENTICATED, "missing token", lambda: asyncio.run(peers(None)))
    expect(C.UNAUTHENTICATED, "wrong token", lambda: asyncio.run(peers("nope")))
    assert asyncio.run(peers("s3cret")) == 0


def test_daemon_still_serves_after_bad_input(pair: tuple[Daemon, Daemon]) -> None:
    async def go() -> None:
        c = Client(*pair)
        held = await c.hold("after-errors", [30, 31])
        st = await c.pull(held, [40, 41])
        done = await c.wait(st.transfer_id)
        assert done.state == scheduler_pb2.TRANSFER_STATE_DONE
        assert await c.digests(c.decode, [40, 41]) == await c.digests(c.prefill, [30, 31])

    asyncio.run(go())
    assert pair[0].alive() and pair[1].alive()  # type: ignore[operator]
