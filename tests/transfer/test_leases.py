"""Lease table with an injected clock: no NIXL, no sleeping."""

from __future__ import annotations

import numpy as np
import pytest

from kvxferd.errors import AlreadyExists, InvalidRequest, LeaseRefused
from kvxferd.transfer.leases import LeaseTable, Released, ReleaseReason


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def table(clock: Clock) -> tuple[LeaseTable, list[Released]]:
    t = LeaseTable(clock=clock)
    seen: list[Released] = []
    t.subscribe(seen.append)
    return t, seen


def test_last_of_two_readers_releases_once(table: tuple[LeaseTable, list[Released]]) -> None:
    t, seen = table
    t.hold("r", [np.array([3, 4]), np.array([9])], readers=2, ttl_s=5)
    t.confirm_and_extend("r")
    assert t.complete("r", "dec-a") is None
    assert t.complete("r", "dec-a") is None  # a duplicate from the same reader counts once
    assert seen == []
    rel = t.complete("r", "dec-b")
    assert rel is not None and rel.reason is ReleaseReason.DONE and rel.readers_done == 2
    assert [s.request_id for s in seen] == ["r"]
    assert rel.kernel_blocks[0].tolist() == [3, 4] and rel.kernel_blocks[1].tolist() == [9]
    assert t.complete("r", "dec-c") is None  # late: nothing more is released
    assert len(seen) == 1 and len(t) == 0


def test_confirm_after_expiry_is_refused_and_reported(
    clock: Clock, table: tuple[LeaseTable, list[Released]]
) -> None:
    t, seen = table
    t.hold("r", [np.arange(2)], readers=1, ttl_s=1.0)
    clock.now += 1.0
    with pytest.raises(LeaseRefused, match="EXPIRED"):
        t.confirm_and_extend("r")
    assert [(s.request_id, s.reason) for s in seen] == [("r", ReleaseReason.EXPIRED)]
    with pytest.raises(LeaseRefused):
        t.confirm_and_extend("r")
    assert len(seen) == 1


def test_confirm_extends(clock: Clock, table: tuple[LeaseTable, list[Released]]) -> None:
    t, _ = table
    t.hold("r", [np.arange(2)], readers=1, ttl_s=1.0)
    clock.now += 0.9
    lease = t.confirm_and_extend("r", ttl_s=2.0)
    assert lease.expires_at == pytest.approx(clock.now + 2.0)
    clock.now += 1.5
    assert t.reap() == []
    clock.now += 0.6
    assert [r.reason for r in t.reap()] == [ReleaseReason.EXPIRED]


def test_unknown_and_released_are_refused(table: tuple[LeaseTable, list[Released]]) -> None:
    t, _ = table
    with pytest.raises(LeaseRefused, match="unknown"):
        t.confirm_and_extend("nope")
    t.hold("r", [np.arange(2)], readers=1, ttl_s=1.0)
    assert t.cancel("r").reason is ReleaseReason.CANCELLED
    with pytest.raises(LeaseRefused, match="CANCELLED"):
        t.confirm_and_extend("r")


def test_reap_scans_everything(clock: Clock, table: tuple[LeaseTable, list[Released]]) -> None:
    t, seen = table
    for i in range(10):
        t.hold(f"r{i}", [np.arange(1)], readers=1, ttl_s=1.0 + i)
    clock.now += 5.5
    assert sorted(r.request_id for r in t.reap()) == [f"r{i}" for i in range(5)]
    assert len(t) == 5 and len(seen) == 5


def test_bad_holds(table: tuple[LeaseTable, list[Released]]) -> None:
    t, _ = table
    t.hold("r", [np.arange(1)], readers=1, ttl_s=1)
    with pytest.raises(AlreadyExists):
        t.hold("r", [np.arange(1)], readers=1, ttl_s=1)
    with pytest.raises(InvalidRequest):
        t.hold("x", [np.arange(1)], readers=0, ttl_s=1)
    with pytest.raises(InvalidRequest):
        t.hold("x", [np.arange(1)], readers=1, ttl_s=0)
    with pytest.raises(InvalidRequest):
        t.hold("", [np.arange(1)], readers=1, ttl_s=1)


def test_callback_errors_do_not_break_the_table(clock: Clock) -> None:
    t = LeaseTable(clock=clock)

    def boom(_: Released) -> None:
        raise RuntimeError("callback bug")

    t.subscribe(boom)
    t.hold("r", [np.arange(1)], readers=1, ttl_s=1)
    assert t.complete("r", "a") is not None
    assert len(t) == 0
