"""Issue 11, item 1, with an engine that reuses blocks the moment they are released (bytes
checked): a lease held for two readers, reader A mid-read, a third party releasing and sending
forged tickets. Before per-reader leases the third party's release freed the blocks, the engine
restamped them, and the second reader's pull ended DONE with the wrong bytes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from grpc import aio

from kvxferd.scenario.daemons import DaemonOptions
from tests.attach.test_attach import PRESET, Engine, _digests, _pull
from tests.service.conftest import Daemon, launch
from tests.service.raw_peer import handshake

DONE_STATE = 5  # TRANSFER_STATE_DONE


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    ds = launch(
        tmp_path_factory.mktemp("attach-safety"),
        DaemonOptions("att", PRESET, extra=("--set", "pool.mode=attached")),
        DaemonOptions("decode", PRESET),
    )
    yield ds["att"], ds["decode"]
    ds.stop()


@pytest.mark.slow
def test_a_third_party_release_never_lets_the_engine_overwrite_a_readers_blocks(
    pair: tuple[Daemon, Daemon],
) -> None:
    att, decode = pair
    eng = Engine(
        att.engine_socket,
        *("--request", "reuse-1", "--blocks", "4,5,6,7", "--readers", "2"),
        *("--seed", "31", "--overwrite-on-release", "77"),
    )
    try:
        ticket = eng.line()["ticket"]
        held = _digests(att.grpc, [4, 5, 6, 7])

        async def strangers() -> None:
            reader_a = await handshake(att.grpc, PRESET, agent="reader-a")
            await reader_a.confirm("reuse-1", extend_ms=30_000)  # A is mid-read from here on
            third = await handshake(att.grpc, PRESET, agent="third-party")
            with pytest.raises(aio.AioRpcError):
                await third.release("reuse-1")
            with pytest.raises(aio.AioRpcError):
                await third.release("reuse-1", done=True)
            await reader_a.heartbeat(["reuse-1"], 5_000)

        asyncio.run(strangers())
        assert _digests(att.grpc, [4, 5, 6, 7]) == held, "the engine reused blocks A still reads"
        done = _pull(decode, ticket, [20, 21, 22, 23])
        assert done.state == DONE_STATE, done.error.message
        assert _digests(decode.grpc, [20, 21, 22, 23]) == held
        # Once the reader A has let go too, the engine gets them and really reuses them (so the
        # checks above could have failed).
        event = eng.line()  # A's share lapses at the heartbeat timeout (no further heartbeats)
        assert event["released"] == "reuse-1"
        assert _digests(att.grpc, [4, 5, 6, 7]) != held
    finally:
        eng.kill()
