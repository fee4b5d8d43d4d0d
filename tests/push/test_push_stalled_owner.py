"""Push mode with a stalled owner (kvxferd/daemon/receiver.py; scheduler.proto, docs/nixl.md
§9): a prefill daemon stopped mid-WRITE (SIGSTOP, as a paused VM or a starved process) keeps
no timeout of its own, and its WRITE goes on when it resumes. The decode daemon must not end
the pull before that WRITE is over: a terminal status other than DONE lets its engine reuse
the blocks, which the late WRITE would then overwrite.

Before: the decode daemon ended the pull EXPIRED at its deadline, listing every block, while
the owner was stopped; after SIGCONT every block changed again (a review's repro, 3 of 3).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest

from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import scheduler_pb2
from tests.push.client import TERMINAL, Client
from tests.push.conftest import mode_config
from tests.service.conftest import Daemons, launch

N = 256  # blocks of 2 MiB: a WRITE long enough to stop the owner in the middle of
DONE = scheduler_pb2.TRANSFER_STATE_DONE


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    tmp = tmp_path_factory.mktemp("push-stalled")
    on = mode_config(tmp, "push")
    ds = launch(
        tmp,
        DaemonOptions("prefill", f"dense:num_blocks={N}", fill_seed=3, extra=on),
        DaemonOptions("decode", f"dense:num_blocks={N}", extra=on),
    )
    yield ds
    ds.stop()


async def _state(c: Client, tid: str) -> scheduler_pb2.TransferStatus:
    req = scheduler_pb2.GetTransferRequest(transfer_id=tid)
    return (await c.decode.GetTransfer(req)).status


def test_a_push_does_not_end_while_its_stopped_owner_may_still_write(pair: Daemons) -> None:
    pid = pair.set["prefill"].ready.pid  # type: ignore[union-attr]
    assert pid > 0

    async def go() -> None:
        c = Client(pair["prefill"], pair["decode"])
        ids = list(range(N))
        assert (await c.pull(await c.hold("warm", [[0]]), [[0]])).state == DONE
        t0 = time.monotonic()
        assert (await c.pull(await c.hold("measure", [ids]), [ids])).state == DONE
        write_s = time.monotonic() - t0
        deadline_s = max(0.6, 3 * write_s)
        for trial in range(4):  # a WRITE that ends before the stop lands is tried again
            k = 37 * (trial + 1)
            remote = ids[k:] + ids[:k]  # other bytes than the blocks hold now
            held = await c.hold(f"stalled-{trial}", [remote])
            st = await c.start(held, [ids], deadline_ms=int(deadline_s * 1000))
            await asyncio.sleep(0.3 * write_s)  # mid-WRITE
            os.kill(pid, signal.SIGSTOP)
            try:
                stop_until = time.monotonic() + deadline_s + 1.5  # well past the deadline
                while time.monotonic() < stop_until:
                    now = await _state(c, st.transfer_id)
                    if now.state in TERMINAL:
                        break
                    await asyncio.sleep(0.05)
            finally:
                os.kill(pid, signal.SIGCONT)
            if now.state == DONE:
                continue  # the WRITE had landed before the stop: nothing was tested
            assert now.state not in TERMINAL, (
                f"the push ended {scheduler_pb2.TransferState.Name(now.state)} while its owner"
                f" was stopped mid-WRITE: {now.error.message}"
            )
            end = await c.wait(st.transfer_id)  # the owner resumed: its WRITE ends, it answers
            at_end = await c.local_digests([ids])
            await asyncio.sleep(1.0)
            assert await c.local_digests([ids]) == at_end  # nothing lands after the end
            if end.state != DONE:  # every block the late WRITE may have touched is listed
                assert sorted(end.invalid_local_block_ids.groups[0].ids) == ids
            else:
                assert await c.same([remote], [ids])
            return
        pytest.skip("every WRITE ended before the owner could be stopped in its middle")

    asyncio.run(go())
