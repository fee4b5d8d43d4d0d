"""TransferEngine: a transfer submitted while the NIXL thread is replacing its peer or swapping
the local regions (kvxferd/transfer/engine.py). The window is inside the NIXL thread's own
swap (after it listed the transfers to end, before the new state is installed), which a real
agent gives no way to hold open; a stand-in agent on a real NixlThread stops the thread there.

What must hold (engine.py): a replaced peer "has its in-flight transfers cancelled" and
set_local cancels "every transfer in flight first, since its local memory is about to change";
so a transfer admitted against the old state is never posted with its old descriptors, and the
byte budget it took goes back to the entry it was admitted against."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvxferd.blocks.ranges import RegionRanges, TransferPlan
from kvxferd.nixl import MemType, XferOp, XferState
from kvxferd.nixl.worker import NixlThread
from kvxferd.transfer import TransferEngine, TransferStatus

OLD_REMOTE = np.array([[0x7000000, 1 << 20, 0]], dtype=np.int64)
NEW_REMOTE = np.array([[0x9000000, 1 << 20, 0]], dtype=np.int64)  # the restarted owner's
LOCAL = np.array([[0x10000, 1 << 20, 0]], dtype=np.int64)
NEW_LOCAL = np.array([[0x500000, 1 << 20, 0]], dtype=np.int64)


class Posted:
    def __init__(self, peer: str, metadata: bytes, local: Any, remote: Any) -> None:
        self.peer, self.metadata = peer, metadata
        self.local, self.remote = local.copy(), remote.copy()
        self.released = False


class StandInAgent:
    """The NixlAgent calls TransferEngine makes, on a real NixlThread; transfers never end by
    themselves. ``hold_in`` names a call ("add_remote" or "release") that, once, stops the NIXL
    thread inside it until ``go`` is set, after setting ``inside``."""

    def __init__(self) -> None:
        self._thread = NixlThread("stand-in", idle_wait_s=0.001)
        self._thread.start()
        self.remotes: dict[str, bytes] = {}
        self.posts: list[Posted] = []
        self.hold_in = ""
        self.inside, self.go = threading.Event(), threading.Event()

    def _maybe_hold(self, call: str) -> None:
        if self.hold_in == call:
            self.hold_in = ""
            self.inside.set()
            self.go.wait(5)

    def add_poller(self, poller: Callable[[], float | None]) -> None:
        self._thread.add_poller(poller)

    def remove_poller(self, poller: Callable[[], float | None]) -> None:
        self._thread.remove_poller(poller)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._thread.submit(fn, *args)

    def add_remote(self, name: str, metadata: bytes) -> None:
        self._maybe_hold("add_remote")
        self.remotes[name] = metadata

    def has_remote(self, name: str) -> bool:
        return name in self.remotes

    def remove_remote(self, name: str) -> None:
        self.remotes.pop(name, None)

    def post(
        self, op: XferOp, local: Any, remote: Any, *, peer: str, notif: bytes = b"", **_: Any
    ) -> Posted:
        posted = Posted(peer, self.remotes[peer], local, remote)
        self.posts.append(posted)
        return posted

    def poll(self, handle: Posted) -> XferState:
        return XferState.IN_PROGRESS

    def telemetry(self, handle: Posted) -> None:
        return None

    def release(self, handle: Posted) -> bool:
        self._maybe_hold("release")
        handle.released = True
        return True

    def send_notif(self, peer: str, msg: bytes) -> None:
        pass

    def stop(self) -> None:
        self._thread.stop()


def _plan(nbytes: int) -> TransferPlan:
    def a(v: list[int]) -> np.ndarray:
        return np.asarray(v, dtype=np.int64)

    return TransferPlan((RegionRanges(0, "r", a([0]), a([0]), a([nbytes])),))


@pytest.fixture
def agent() -> Any:
    a = StandInAgent()
    yield a
    a.go.set()
    a.stop()


def _during(agent: StandInAgent, call: str, swap: Callable[[], None]) -> threading.Thread:
    """Run ``swap`` from another thread and return once the NIXL thread is held inside
    ``call`` during it."""
    agent.hold_in = call
    thread = threading.Thread(target=swap)
    thread.start()
    assert agent.inside.wait(5), f"the swap never reached {call}"
    return thread


def test_a_transfer_admitted_while_its_peer_is_replaced_is_never_posted_to_the_new_one(
    agent: StandInAgent,
) -> None:
    engine = TransferEngine(agent, LOCAL)  # type: ignore[arg-type]
    engine.start()
    try:
        engine.connect_peer("owner", b"old", OLD_REMOTE)
        prep = engine.prepare("t1", "owner", _plan(1 << 19))  # the old owner's addresses
        swap = _during(
            agent, "add_remote", lambda: engine.connect_peer("owner", b"new", NEW_REMOTE)
        )
        xfer = engine.submit_prepared(prep, timeout_s=5)  # the old entry is still installed
        agent.go.set()
        swap.join(5)
        res = xfer.result(5)
        assert res.status is TransferStatus.CANCELLED and "replaced" in res.reason
        assert not [p for p in agent.posts if p.metadata == b"new"]  # nothing reached the new one
        assert engine.inflight_bytes("owner") == 0  # not charged to the new entry
        later = engine.submit("t2", "owner", _plan(4096), timeout_s=5)
        time.sleep(0.05)
        assert [int(p.remote[0, 0]) for p in agent.posts] == [int(NEW_REMOTE[0, 0])]
        assert engine.inflight_bytes("owner") == 4096
        engine.cancel(later.transfer_id).result(5)
        assert engine.inflight_bytes("owner") == 0
    finally:
        engine.close()


def test_a_transfer_admitted_while_the_local_pool_is_swapped_is_never_posted_into_the_old_one(
    agent: StandInAgent,
) -> None:
    engine = TransferEngine(agent, LOCAL)  # type: ignore[arg-type]
    engine.start()
    try:
        engine.connect_peer("owner", b"md", OLD_REMOTE)
        running = engine.submit("t0", "owner", _plan(4096), timeout_s=30)  # one in flight
        time.sleep(0.05)
        assert running.status is TransferStatus.IN_PROGRESS
        prep = engine.prepare("t1", "owner", _plan(1 << 19))  # into the old local pool
        # set_local -> cancel everything in flight: held while it releases t0's handle.
        swap = _during(
            agent, "release", lambda: engine.set_local(NEW_LOCAL, MemType.DRAM, "re-attached")
        )
        xfer = engine.submit_prepared(prep, timeout_s=30)
        agent.go.set()
        swap.join(5)  # set_local returned: nothing may still write into the old pool
        time.sleep(0.05)
        live = [p for p in agent.posts if not p.released]
        assert not [p for p in live if int(p.local[0, 0]) == int(LOCAL[0, 0])]
        res = xfer.result(5)
        assert res.status is TransferStatus.CANCELLED and "local KV pool changed" in res.reason
        assert engine.inflight_bytes("owner") == 0
    finally:
        engine.close()
