"""A READ_DONE is due from a share's grant until the share ends: the lease table says how long
the pump may wait (``LeaseTable.due``, kvxferd/transfer/due.py), short within a window after
the last grant, longer after it, the agent's idle wait once nothing is due; a grant wakes a
resting NIXL thread (kvxferd/transfer/owner.py); ``NixlThread.wake`` cuts the thread's wait
short."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from kvxferd.errors import LeaseRefused
from kvxferd.nixl.worker import NixlThread
from kvxferd.transfer import notify
from kvxferd.transfer.due import PRUNE_AT
from kvxferd.transfer.leases import LeaseTable, ReleaseReason
from kvxferd.transfer.owner import (
    READ_DUE_LONG_S,
    READ_DUE_SPIN_S,
    READ_DUE_WAIT_S,
    NotificationPump,
)

WINDOW_S = 0.005


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeAgent:
    """What the pump uses of a NixlAgent: its notifications, its poller hook and wake()."""

    def __init__(self) -> None:
        self.inbox: dict[str, list[bytes]] = {}
        self.wakes = 0
        self.pollers: list[Any] = []

    def get_notifs(self) -> dict[str, list[bytes]]:
        out, self.inbox = self.inbox, {}
        return out

    def add_poller(self, poller: Any) -> None:
        self.pollers.append(poller)

    def remove_poller(self, poller: Any) -> None:
        self.pollers.remove(poller)

    def wake(self) -> None:
        self.wakes += 1


def held(table: LeaseTable, request_id: str, readers: int = 1) -> None:
    table.hold(request_id, [np.array([1, 2])], readers=readers, ttl_s=60)


SHORT, LONG = 1e-5, 1e-3  # the waits the tests ask ReadDue.wait for


def due(table: LeaseTable) -> float | None:
    return table.due.wait(WINDOW_S, SHORT, LONG)


def read_once(table: LeaseTable, request_id: str) -> None:
    """Hold, grant and notify ``request_id``: due from the grant until its READ_DONE."""
    held(table, request_id)
    ticket = table.confirm(request_id, "dec", 5).ticket
    assert due(table) == SHORT
    assert table.notified(request_id, ticket)
    assert due(table) is None


def test_nothing_is_due_before_a_grant() -> None:
    table = LeaseTable(clock=Clock())
    held(table, "r")
    assert due(table) is None


def test_a_grant_is_due_until_its_read_done() -> None:
    read_once(LeaseTable(clock=Clock()), "r")


def test_two_grants_stay_due_until_both_are_notified() -> None:
    table = LeaseTable(clock=Clock())
    held(table, "a")
    held(table, "b")
    ta = table.confirm("a", "dec", 5).ticket
    tb = table.confirm("b", "dec", 5).ticket
    assert table.notified("a", ta)
    assert due(table) == SHORT and len(table.due) == 1
    assert table.notified("b", tb)
    assert due(table) is None and len(table.due) == 0


def test_each_counted_read_done_reports_its_time_since_the_grant() -> None:
    clock = Clock()
    table = LeaseTable(clock=clock)
    seen: list[float] = []
    table.due.on_read_done = seen.append
    held(table, "r")
    ticket = table.confirm("r", "dec", 5).ticket
    clock.now += 0.25
    assert not table.notified("r", ticket + 1)  # stray: not reported
    assert table.notified("r", ticket)
    assert seen == [pytest.approx(0.25)]


def test_a_stray_notification_does_not_end_what_is_due() -> None:
    table = LeaseTable(clock=Clock())
    held(table, "r")
    ticket = table.confirm("r", "dec", 5).ticket
    assert not table.notified("r", ticket + 1)  # the wrong ticket
    assert not table.notified("other", ticket)  # an unknown request
    assert due(table) == SHORT


def test_a_share_still_reading_after_the_window_is_due_at_the_longer_wait() -> None:
    clock = Clock()
    table = LeaseTable(clock=clock)
    held(table, "r")
    ticket = table.confirm("r", "dec", 60).ticket
    clock.now += 2 * WINDOW_S  # a long READ between hosts
    assert due(table) == LONG
    assert table.notified("r", ticket)
    assert due(table) is None


@pytest.mark.parametrize("how", ["finish", "decline", "lapse", "detach", "reader_gone"])
def test_a_share_ended_without_a_notification_is_no_longer_due(how: str) -> None:
    clock = Clock()
    table = LeaseTable(clock=clock)
    held(table, "r")
    table.confirm("r", "dec", 5)
    assert due(table) == SHORT
    if how == "finish":
        table.finish("r", "dec", done=True)  # FinishPull
    elif how == "decline":
        table.decline("r", "dec")
    elif how == "lapse":
        clock.now += 6  # past the share's 5 s: the pump's reaping lapses it
        table.reap()
    elif how == "detach":
        table.cancel("r", ReleaseReason.ENGINE_DETACHED)
    else:
        table.reader_gone("dec")
    assert due(table) is None
    read_once(table, "s")  # and the next grant is due until its own READ_DONE


def test_ended_shares_are_not_kept_when_nothing_asks() -> None:
    table = LeaseTable(clock=Clock())
    for i in range(1000):  # granted and read, and no pump ever asks what is due
        read_done = f"r{i}"
        held(table, read_done)
        assert table.notified(read_done, table.confirm(read_done, "dec", 5).ticket)
    assert len(table.due) <= 2 * PRUNE_AT
    held(table, "still")
    table.confirm("still", "dec", 5)
    assert due(table) == SHORT and len(table.due) == 1  # the one still reading


def test_a_renewed_confirmation_extends_the_window_without_counting_twice() -> None:
    clock = Clock()
    table = LeaseTable(clock=clock)
    held(table, "r")
    ticket = table.confirm("r", "dec", 5).ticket
    clock.now += WINDOW_S * 0.8
    assert table.confirm("r", "dec", 5).ticket == ticket  # the same share, renewed
    clock.now += WINDOW_S * 0.8  # past the first grant's window, not the renewal's
    assert due(table) == SHORT and len(table.due) == 1
    assert table.notified("r", ticket)
    assert due(table) is None


def test_a_refused_confirmation_is_not_a_grant() -> None:
    table = LeaseTable(clock=Clock())
    grants: list[None] = []
    table.due.on_grant = lambda: grants.append(None)
    held(table, "r")
    table.confirm("r", "a", 5)
    with pytest.raises(LeaseRefused, match="all of them have confirmed"):  # one reader expected
        table.confirm("r", "b", 5)
    assert len(grants) == 1


def pump_with(spin: bool, window_s: float = WINDOW_S) -> tuple[NotificationPump, FakeAgent, Clock]:
    clock = Clock()
    table = LeaseTable(clock=clock)
    agent = FakeAgent()
    pump = NotificationPump(agent, table, clock=clock)  # type: ignore[arg-type]
    pump.prompt_reads(window_s, spin=spin)
    return pump, agent, clock


@pytest.mark.parametrize(("spin", "wait"), [(True, READ_DUE_SPIN_S), (False, READ_DUE_WAIT_S)])
def test_the_pump_polls_promptly_while_a_read_done_is_due(spin: bool, wait: float) -> None:
    pump, agent, _ = pump_with(spin)
    table = pump._leases
    held(table, "r")
    assert pump.poll() is None  # nothing due: the agent's idle wait
    ticket = table.confirm("r", "dec", 5).ticket
    assert pump.poll() == wait
    agent.inbox = {"dec-agent": [notify.encode("r", ticket)]}
    assert pump.poll() is None  # counted: back to the idle wait
    assert "r" not in table  # and the blocks went back


def test_past_the_window_the_pump_polls_slower_and_a_grant_wakes_it() -> None:
    pump, agent, clock = pump_with(spin=True)
    table = pump._leases
    for rid in ("r", "s"):
        held(table, rid)
    table.confirm("r", "dec", 60)
    assert pump.poll() == READ_DUE_SPIN_S
    clock.now += 2 * WINDOW_S  # still reading: a long READ
    assert pump.poll() == READ_DUE_LONG_S
    wakes = agent.wakes
    table.confirm("s", "dec", 60)  # a new grant: the short wait again, at once
    assert agent.wakes == wakes + 1
    assert pump.poll() == READ_DUE_SPIN_S
    clock.now += 61  # both shares lapse unread: nothing is due any more
    assert pump.poll() is None


def test_a_grant_wakes_a_resting_thread_once() -> None:
    pump, agent, _ = pump_with(spin=True)
    table = pump._leases
    for rid in ("a", "b"):
        held(table, rid)
    assert pump.poll() is None  # resting
    table.confirm("a", "dec", 5)  # no running loop here: woken at once
    assert agent.wakes == 1
    table.confirm("b", "dec", 5)  # already woken: the next poll sees both due
    assert agent.wakes == 1
    assert pump.poll() == READ_DUE_SPIN_S


def test_a_window_of_zero_turns_prompt_reads_off() -> None:
    pump, agent, _ = pump_with(spin=True, window_s=0.0)
    held(pump._leases, "r")
    assert pump.poll() is None
    pump._leases.confirm("r", "dec", 5)
    assert pump.poll() is None
    assert agent.wakes == 0


def test_a_negative_window_is_refused() -> None:
    pump, _, _ = pump_with(spin=True)
    with pytest.raises(ValueError, match="window"):
        pump.prompt_reads(-1.0, spin=True)


def test_wake_cuts_the_nixl_threads_idle_wait_short() -> None:
    thread = NixlThread("wake-test", idle_wait_s=60.0)
    polled = threading.Event()
    thread.add_poller(lambda: (polled.set(), None)[1])
    thread.start()
    try:
        time.sleep(0.05)  # asleep in its first 60 s wait now
        assert not polled.is_set()
        thread.wake()
        assert polled.wait(10), "wake() did not run the pollers before the 60 s wait ended"
        assert thread.call(lambda: 7) == 7  # tasks still run after a wake
    finally:
        thread.stop()
