"""STAGED pulls over one ``Peer.Stage`` stream between real daemons (issue 14, item 4).

Every pull's bytes are checked through both daemons' Checksum; the owner's "staged stream
ended" log line says how many chunks it gathered, announced and got back, and how far it had
got when the reader stopped. Tiny dense rows (1 KiB) make pulls of many chunks cheap.
"""

from __future__ import annotations

import asyncio
import random
import urllib.request
from collections.abc import Iterator

import pytest

from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import scheduler_pb2
from tests.service.conftest import Daemon, Daemons, launch
from tests.staging.stage_rig import Client, granted_slots, log_lines, staging, wait_log

TINY = "dense:num_blocks=256,num_layers=2,num_kv_heads=1,head_size=8"
ROW = 1024  # one TINY block row: 2 layers x K and V x 16 tokens x 8 x 2 bytes
DONE = scheduler_pb2.TRANSFER_STATE_DONE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    """A prefill daemon with a 4-slot ring of 4 rows (2 slots per reader) and two decode
    daemons forced STAGED with 1-row slots (so every block is one chunk)."""
    ds = launch(
        tmp_path_factory.mktemp("stage"),
        DaemonOptions("prefill", TINY, fill_seed=21, extra=staging("auto", 4 * ROW, 4)),
        DaemonOptions("d1", TINY, extra=staging("staged", ROW, 4)),
        DaemonOptions("d2", TINY, extra=staging("staged", ROW, 4)),
    )
    yield ds
    ds.stop()


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_more_chunks_than_credits_stream_byte_exact(tiny: Daemons) -> None:
    async def go() -> None:
        c = Client(tiny["prefill"], tiny["d1"])
        rng = random.Random(3)
        remote, local = rng.sample(range(256), 40), rng.sample(range(256), 40)
        st = await c.pull(await c.hold("more-chunks", [remote]), [local])
        assert st.state == DONE, st.error.message
        assert st.strategy == scheduler_pb2.TRANSFER_STRATEGY_STAGED
        assert st.stage_times.chunks == 40
        assert await c.same([remote], [local])
        # One stream: 40 chunks through 2 credits, every slot given back, none left granted.
        end = await wait_log(tiny["prefill"].log, "staged stream ended", request_id="more-chunks")
        assert end["reason"] == "done", end
        assert end["chunks"] == end["gathered"] == end["announced"] == end["returned"] == 40
        assert end["inline"] == 40  # 1 KiB chunks, a slot free at once: gathered on the loop
        pulled = log_lines(tiny["d1"].log, "pull finished", request_id="more-chunks")
        assert pulled and pulled[0]["stream"] == 1 and pulled[0]["control_ms"] > 0, pulled
        assert granted_slots(tiny["prefill"]) == 0
        # The stream's stage times in the status (scheduler.proto StageTimes 7-10) ...
        t = st.stage_times
        assert t.stream and t.control_seconds > 0 and t.owner_start_seconds > 0, t
        assert t.owner_slot_wait_seconds >= 0
        assert abs(t.control_seconds * 1e3 - pulled[0]["control_ms"]) < 1e-3
        # ... and in kvxferd_staged_stage_seconds (observed for stream pulls only).
        for stage in ("control", "owner_start", "owner_slot_wait"):
            assert stage_count(tiny["d1"], stage) >= 1, stage
        assert stage_count(tiny["prefill"], "control") == 0  # it pulled nothing

    run(go())


def stage_count(daemon: Daemon, stage: str) -> float:
    url = f"http://{daemon.metrics}/metrics"
    want = f'kvxferd_staged_stage_seconds_count{{stage="{stage}"}}'
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line.startswith(want):
            return float(line.split()[-1])
    raise AssertionError(f"no {want} series")


def test_two_readers_share_the_ring_within_their_caps(tiny: Daemons) -> None:
    async def go() -> None:
        a, b = Client(tiny["prefill"], tiny["d1"]), Client(tiny["prefill"], tiny["d2"])
        rng = random.Random(5)
        jobs = []
        locals_ = rng.sample(range(256), 60)  # disjoint on each decode daemon
        for i, c in enumerate((a, b, a, b)):
            remote, local = rng.sample(range(256), 30), locals_[i // 2 * 30 : i // 2 * 30 + 30]
            jobs.append((c, remote, local, await c.hold(f"share-{i}", [remote])))
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, await asyncio.to_thread(granted_slots, tiny["prefill"]))
                await asyncio.sleep(0.005)

        watcher = asyncio.ensure_future(watch())
        done = await asyncio.gather(*(c.pull(h, [lo]) for c, _, lo, h in jobs))
        watcher.cancel()
        for st in done:
            assert st.state == DONE, st.error.message
        for c, remote, local, _ in jobs:
            assert await c.same([remote], [local])
        assert peak <= 4  # the ring; each reader at most its cap of 2 (logged per stream)
        for i in range(4):
            end = log_lines(tiny["prefill"].log, "staged stream ended", request_id=f"share-{i}")
            assert end and end[0]["returned"] == 30, end

    run(go())


def test_cancel_mid_pull_stops_the_owner_within_one_chunk(tiny: Daemons) -> None:
    async def go() -> None:
        c = Client(tiny["prefill"], tiny["d1"])
        remote, local = list(range(250)), list(range(255, 5, -1))
        for attempt in range(5):  # a pull that ends before the cancel lands is tried again
            rid = f"cancel-{attempt}"
            tid = (await c.start(await c.hold(rid, [remote]), [local])).transfer_id
            # Cancel once the owner serves the stream (a cancel that lands before the stream
            # opens, as it may on a loaded machine, leaves the owner nothing to stop).
            for _ in range(500):
                if granted_slots(tiny["prefill"]) > 0:
                    break
                await asyncio.sleep(0.01)
            got = await c.decode.CancelTransfer(
                scheduler_pb2.CancelTransferRequest(transfer_id=tid)
            )
            st = await c.wait(tid) if got.status.state not in (DONE,) else got.status
            if st.state == DONE:
                continue
            assert st.state == scheduler_pb2.TRANSFER_STATE_CANCELLED, st.error.message
            assert sorted(st.invalid_local_block_ids.groups[0].ids) == sorted(local)
            end = await wait_log(tiny["prefill"].log, "staged stream ended", request_id=rid)
            # The reader closes its stream and gives its lease share up: whichever reaches the
            # owner first stops the stream.
            assert end["reason"] in ("cancelled", "reader closed", "lease ended"), end
            assert end["gathered_at_stop"] < 250, end  # stopped mid-pull
            assert end["started"] <= end["gathered_at_stop"] + 1, end  # within one chunk
            assert end["gathered"] <= end["started"]
            break
        else:
            pytest.fail("every pull finished before its cancel")
        # Every slot came back: the next pull completes, byte-exact.
        st2 = await c.pull(await c.hold("after-cancel", [[7, 8, 9]]), [[1, 2, 3]])
        assert st2.state == DONE, st2.error.message
        assert await c.same([[7, 8, 9]], [[1, 2, 3]])
        assert granted_slots(tiny["prefill"]) == 0

    run(go())


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    """Hybrid (attention + Mamba) and MLA pairs, decode sides forced STAGED."""
    ds = launch(
        tmp_path_factory.mktemp("stage-mixed"),
        DaemonOptions("h-prefill", "hybrid", fill_seed=9, extra=staging("auto", 1 << 20, 4)),
        DaemonOptions("h-decode", "hybrid", extra=staging("staged", 1 << 20, 4)),
        DaemonOptions(
            "m-prefill",
            "mla:num_blocks=32,num_layers=4",
            fill_seed=8,
            extra=staging("auto", 1 << 20, 4),
        ),
        DaemonOptions(
            "m-decode", "mla:num_blocks=32,num_layers=4", extra=staging("staged", 300_000, 4)
        ),
    )
    yield ds
    ds.stop()


@pytest.mark.parametrize(
    ("pair", "remote", "local"),
    [
        ("h", [[3, 11, 7, 1], [5, 2]], [[14, 0, 9, 4], [2, 7]]),
        ("m", [[30, 2, 17, 8, 21]], [[1, 29, 4, 13, 0]]),
    ],
)
def test_hybrid_and_mla_pulls_stream_byte_exact(
    mixed: Daemons, pair: str, remote: list[list[int]], local: list[list[int]]
) -> None:
    async def go() -> None:
        c = Client(mixed[f"{pair}-prefill"], mixed[f"{pair}-decode"])
        rid = f"mixed-{pair}"
        st = await c.pull(await c.hold(rid, remote), local)
        assert st.state == DONE, st.error.message
        assert st.strategy == scheduler_pb2.TRANSFER_STRATEGY_STAGED, st.strategy_reason
        assert st.stage_times.chunks > 1
        assert await c.same(remote, local)
        end = await wait_log(mixed[f"{pair}-prefill"].log, "staged stream ended", request_id=rid)
        assert end["reason"] == "done" and end["returned"] == st.stage_times.chunks, end
        # Every chunk holds a row of over 256 KiB (hybrid's Mamba rows, MLA's): the worker thread.
        assert end["inline"] == 0, end

    run(go())
