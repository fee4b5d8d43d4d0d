"""Push mode across re-attaches of the decode (reader) daemon's own pool.

In push mode the prefill (owner) daemon WRITEs into the decode daemon's registered pool, at the
addresses and through the NIXL registrations the decode daemon's handshake described. When the
decode daemon's engine detaches and attaches again, its registration generation changes (new
memory, new registrations) while its instance ID does not; its next pull handshakes again
(``PeerDirectory.stale_all``) and describes the new pool. The owner must WRITE the next push
into that pool, not into the dropped one the earlier push was written to.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from kvxferd.engine import EngineClient
from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import scheduler_pb2
from tests.push.client import Client
from tests.push.conftest import mode_config
from tests.service.conftest import launch

OWNER = "dense:num_blocks=64"
# The decode engine restarts with another pool size (as vLLM does when its memory profile
# changes): the new regions cannot sit at the old addresses, so a WRITE planned from the old
# handshake cannot land in the new pool by luck. It then comes back with the first size.
LAYOUTS = ("dense:num_blocks=64", "dense:num_blocks=96", "dense:num_blocks=64")


def test_pushes_land_in_the_pool_the_reader_attached_last(tmp_path: Path) -> None:
    on = mode_config(tmp_path, "push")
    ds = launch(
        tmp_path,
        DaemonOptions("prefill", OWNER, fill_seed=3, extra=on),
        DaemonOptions("decode", OWNER, extra=(*on, "--set", "pool.mode=attached")),
    )
    prefill, decode = ds["prefill"], ds["decode"]
    remote, local = [5, 17, 9, 40], [12, 3, 30, 21]

    async def go() -> None:
        c = Client(prefill, decode)
        with EngineClient(decode.engine_socket) as engine:
            generation = 0
            for i, layout in enumerate(LAYOUTS):
                att = await asyncio.to_thread(engine.attach, layout)
                assert att.generation > generation  # new memory; the same daemon instance
                generation = att.generation
                others = [b for b in range(int(layout.split("=")[1])) if b not in local]
                blank, untouched = await c.local_digests([local]), await c.local_digests([others])
                held = await c.hold(f"push-{i}", [remote])
                st = await c.start(held, [local], deadline_ms=2000)
                done = await c.wait(st.transfer_id)
                assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, (
                    f"push {i} into {layout} (generation {generation}) ended"
                    f" {scheduler_pb2.TransferState.Name(done.state)}: {done.error.message}"
                )
                # The bytes are in the pool the engine attached now, and only there.
                assert await c.same([remote], [local]), f"push {i} did not land in the new pool"
                assert await c.local_digests([local]) != blank
                # Nothing else of the new pool was written (an old plan landed on other blocks).
                assert await c.local_digests([others]) == untouched, f"push {i} wrote elsewhere"
                await asyncio.to_thread(att.detach)

    try:
        asyncio.run(go())
    finally:
        ds.stop()


def test_a_handshake_that_described_a_pool_detached_meanwhile_is_not_used(tmp_path: Path) -> None:
    # The decode daemon's first handshake with the owner is in flight (the owner stopped with
    # SIGSTOP: a stalled peer, for real) while its engine detaches and attaches a pool of
    # another size. That handshake described the old pool: the link must not be made READY
    # with it (the owner would WRITE there), the pull handshakes again and lands in the new one.
    on = mode_config(tmp_path, "push")
    ds = launch(
        tmp_path,
        DaemonOptions("prefill", OWNER, fill_seed=3, extra=on),
        DaemonOptions("decode", OWNER, extra=(*on, "--set", "pool.mode=attached")),
    )
    prefill, decode = ds["prefill"], ds["decode"]
    owner = ds.set["prefill"].proc
    assert owner is not None
    remote, local = [5, 17, 9, 40], [12, 3, 30, 21]
    others = [b for b in range(96) if b not in local]

    async def go() -> None:
        c = Client(prefill, decode)
        with EngineClient(decode.engine_socket) as engine:
            first = await asyncio.to_thread(engine.attach, LAYOUTS[0])
            held = await c.hold("raced", [remote])
            os.kill(owner.pid, signal.SIGSTOP)
            try:
                start = asyncio.ensure_future(c.start(held, [local], deadline_ms=20_000))
                await asyncio.sleep(0.5)  # the handshake is sent, describing the 64-block pool
                assert not start.done()
                await asyncio.to_thread(first.detach)
                now = await asyncio.to_thread(engine.attach, LAYOUTS[1])
                blank = await c.local_digests([local])
                untouched = await c.local_digests([others])
            finally:
                os.kill(owner.pid, signal.SIGCONT)
            done = await c.wait((await start).transfer_id)
            assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
            assert await c.same([remote], [local]), "the push did not land in the new pool"
            assert await c.local_digests([local]) != blank
            assert await c.local_digests([others]) == untouched, "the push wrote elsewhere"
            await asyncio.to_thread(now.detach)

    try:
        asyncio.run(go())
    finally:
        ds.stop()
