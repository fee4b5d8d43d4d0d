"""An owner replaced while a pull waits for its confirmation (real daemons, a real stall).

A pull whose lease share was confirmed by one owner instance must never READ from another
instance that took over the owner's NIXL agent name meanwhile: that instance does not hold
the request, so the pull would end DONE with bytes that are not the held request's.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import scheduler_pb2
from kvxferd.wire.codec import group_ids_to_proto
from tests.service.conftest import launch
from tests.service.test_service_pull import Client, run

SPEC = "dense:num_blocks=64"
DONE = scheduler_pb2.TRANSFER_STATE_DONE
SAME_NAME = ("--set", "nixl.agent_name=review-prefill")
DIRECT = ("--set", "transfer.strategy=direct", "--set", "transfer.cma=false")


@pytest.mark.slow
def test_a_read_confirmed_by_a_stalled_owner_never_reads_its_replacement(tmp_path: Path) -> None:
    """prefill ``p1`` stalls (SIGSTOP) while pull A waits for its ConfirmLease; a restarted
    instance ``p2`` under the same NIXL agent name (another address) is handshaken by pull B
    and replaces ``p1``'s NIXL metadata in the decode daemon (``p1`` does not answer the
    liveness heartbeat). ``p1`` resumes and grants A's share. A must not end DONE with
    ``p2``'s bytes: it either reads ``p1``'s held blocks or fails listing its blocks."""
    ds = launch(
        tmp_path,
        # Default heartbeat settings: a share lasts 5 s from when its ConfirmLease was sent,
        # longer than the stall (the decode daemon gives a silent owner 2 s).
        DaemonOptions("decode", SPEC, extra=DIRECT),
        DaemonOptions("p1", SPEC, fill_seed=41, extra=SAME_NAME),
        DaemonOptions("p2", SPEC, fill_seed=42, extra=SAME_NAME),
    )
    p1_pid = ds.set["p1"].ready.pid  # type: ignore[union-attr]
    stopped = False
    try:
        decode, p1, p2 = ds["decode"], ds["p1"], ds["p2"]

        async def go() -> None:
            nonlocal stopped
            c1, c2 = Client(p1, decode), Client(p2, decode)
            # Warm: decode handshakes p1 (loads agent "review-prefill" = p1).
            held = await c1.hold("warm", [5])
            st = await c1.pull(held, [60])
            assert (await c1.wait(st.transfer_id)).state == DONE

            remote, local = [1, 2, 3], [10, 11, 12]
            want = await c1.digests(c1.prefill, remote)  # the held request's bytes
            other = await c2.digests(c2.prefill, remote)  # p2's bytes at the same blocks
            assert want != other
            held_a = await c1.hold("req-a", remote)

            os.kill(p1_pid, signal.SIGSTOP)
            stopped = True
            # Pull A: the link to p1 is READY, so StartPull returns at once; its
            # ConfirmLease waits on the stalled p1 (asked again while the deadline allows).
            resp = await c1.decode.StartPull(
                scheduler_pb2.StartPullRequest(
                    request_id=held_a.request_id,
                    peer_address=held_a.peer_address,
                    remote_block_ids=held_a.remote_block_ids,
                    local_block_ids=group_ids_to_proto([local]),
                    deadline_ms=25000,
                )
            )
            tid_a = resp.status.transfer_id
            # Pull B from p2 (same agent name, new instance): p1 does not answer the
            # liveness heartbeat, so p2 replaces it in the decode daemon's NIXL agent.
            held_b = await c2.hold("req-b", [7])
            st_b = await c2.pull(held_b, [20])
            done_b = await c2.wait(st_b.transfer_id)
            assert done_b.state == DONE, done_b.error.message
            # p1 comes back and answers A's confirmation.
            t0 = time.monotonic()
            os.kill(p1_pid, signal.SIGCONT)
            stopped = False
            done_a = await asyncio.wait_for(c1.wait(tid_a), 40)
            got = await c1.digests(c1.decode, local)
            if done_a.state == DONE:
                assert got != other, (
                    "pull A ended DONE with p2's bytes (an instance that never held req-a)"
                    f" {time.monotonic() - t0:.1f}s after p1 resumed"
                )
                assert got == want
            else:
                # Not read: nothing written (else every written block must be listed).
                groups = done_a.invalid_local_block_ids.groups
                assert (groups and list(groups[0].ids) == local) or got != other

        run(go())
    finally:
        if stopped:
            os.kill(p1_pid, signal.SIGCONT)
        ds.stop()
