"""Lease table with an injected clock: per-reader shares, no NIXL, no sleeping."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.errors import AlreadyExists, InvalidRequest, LeaseRefused, NotFound, PermissionDenied
from kvxferd.transfer.leases import LeaseTable, LeaseView, Released, ReleaseReason


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
    a = t.confirm("r", "dec-a", 5).ticket
    assert t.notified("r", a)
    assert not t.notified("r", a)  # a replay counts once (and is stray)
    assert seen == []
    b = t.confirm("r", "dec-b", 5).ticket
    assert a != b and t.notified("r", b)
    [rel] = seen
    assert rel.reason is ReleaseReason.DONE and rel.readers_done == 2
    assert rel.kernel_blocks[0].tolist() == [3, 4] and rel.kernel_blocks[1].tolist() == [9]
    assert not t.notified("r", b)  # late: nothing more is released
    assert len(seen) == 1 and len(t) == 0 and t.stray_notifications == 2


def test_third_party_cannot_end_a_readers_share(table: tuple[LeaseTable, list[Released]]) -> None:
    """The freed-block read of issue 11: a party that never confirmed releases the lease while
    reader A is mid-READ. Now it is refused and the blocks stay held for A."""
    t, seen = table
    t.hold("r", [np.arange(4)], readers=2, ttl_s=30)
    t.confirm("r", "reader-a", 10)
    with pytest.raises(PermissionDenied, match="not confirmed"):
        t.finish("r", "third-party", done=False)
    with pytest.raises(PermissionDenied):
        t.extend("r", "third-party", 10)
    assert not t.notified("r", 12345)  # a guessed ticket
    assert seen == [] and "r" in t


def test_a_reader_giving_up_waits_for_the_reader_still_reading(
    table: tuple[LeaseTable, list[Released]],
) -> None:
    t, seen = table
    t.hold("r", [np.arange(4)], readers=2, ttl_s=30)
    a = t.confirm("r", "reader-a", 10).ticket
    t.confirm("r", "reader-b", 10)
    _, released = t.finish("r", "reader-b", done=False)
    assert not released and seen == []
    assert t.notified("r", a)
    [rel] = seen
    assert rel.reason is ReleaseReason.CANCELLED and rel.readers_done == 1


def test_owner_cancel_waits_for_confirmed_readers(
    clock: Clock, table: tuple[LeaseTable, list[Released]]
) -> None:
    t, seen = table
    t.hold("r", [np.arange(4)], readers=1, ttl_s=30)
    t.confirm("r", "reader-a", 2)
    assert t.cancel("r") is False  # a reader is reading: not yet
    with pytest.raises(LeaseRefused, match="cancelled"):
        t.confirm("r", "reader-b", 2)
    assert seen == []
    clock.now += 2.0  # the reader's own share lapses
    t.reap()
    assert [(s.request_id, s.reason) for s in seen] == [("r", ReleaseReason.CANCELLED)]


def test_engine_detach_releases_at_once(table: tuple[LeaseTable, list[Released]]) -> None:
    t, seen = table
    t.hold("r", [np.arange(4)], readers=1, ttl_s=30)
    t.confirm("r", "reader-a", 10)
    assert t.cancel("r", ReleaseReason.ENGINE_DETACHED) is True
    assert [s.reason for s in seen] == [ReleaseReason.ENGINE_DETACHED]


def test_share_lapses_at_its_own_expiry_and_renewal_keeps_it(
    clock: Clock, table: tuple[LeaseTable, list[Released]]
) -> None:
    t, seen = table
    t.hold("r", [np.arange(2)], readers=1, ttl_s=60)
    t.confirm("r", "reader-a", 5)
    clock.now += 4
    assert t.renew("reader-a", ["r"], 5) == []
    clock.now += 4
    t.reap()
    assert seen == []  # renewed at +4 to +9
    clock.now += 2
    t.reap()  # a reader killed mid-pull: released within its share, not the 60 s TTL
    assert [(s.request_id, s.reason) for s in seen] == [("r", ReleaseReason.CANCELLED)]
    assert t.renew("reader-a", ["r", "other"], 5) == ["r", "other"]


def test_reader_gone_lapses_its_shares(table: tuple[LeaseTable, list[Released]]) -> None:
    t, seen = table
    t.hold("r", [np.arange(2)], readers=1, ttl_s=60)
    t.confirm("r", "reader-a", 5)
    assert t.reading("reader-a") == 1
    assert t.reader_gone("reader-a") == 1
    assert [s.reason for s in seen] == [ReleaseReason.CANCELLED]


def test_confirm_after_expiry_is_refused_and_reported(
    clock: Clock, table: tuple[LeaseTable, list[Released]]
) -> None:
    t, seen = table
    t.hold("r", [np.arange(2)], readers=1, ttl_s=1.0)
    clock.now += 1.0
    with pytest.raises(LeaseRefused, match="EXPIRED"):
        t.confirm("r", "a", 1)
    assert [(s.request_id, s.reason) for s in seen] == [("r", ReleaseReason.EXPIRED)]
    with pytest.raises(LeaseRefused):
        t.confirm("r", "a", 1)
    assert len(seen) == 1


def test_more_readers_than_expected_are_refused(table: tuple[LeaseTable, list[Released]]) -> None:
    t, _ = table
    t.hold("r", [np.arange(2)], readers=1, ttl_s=10)
    first = t.confirm("r", "a", 2)
    assert t.confirm("r", "a", 3).ticket == first.ticket  # the same reader renews its share
    with pytest.raises(LeaseRefused, match="1 reader"):
        t.confirm("r", "b", 2)


def test_unknown_is_not_found_and_released_is_refused(
    table: tuple[LeaseTable, list[Released]],
) -> None:
    t, _ = table
    with pytest.raises(NotFound):
        t.confirm("nope", "a", 1)
    t.hold("r", [np.arange(2)], readers=1, ttl_s=5)
    t.cancel("r")
    with pytest.raises(LeaseRefused, match="CANCELLED"):
        t.confirm("r", "a", 1)


def test_bad_holds_are_refused(table: tuple[LeaseTable, list[Released]]) -> None:
    t, _ = table
    with pytest.raises(InvalidRequest):
        t.hold("", [np.arange(2)], readers=1, ttl_s=5)
    with pytest.raises(InvalidRequest):
        t.hold("r", [np.arange(2)], readers=0, ttl_s=5)
    with pytest.raises(InvalidRequest):
        t.hold("r", [np.arange(2)], readers=1, ttl_s=0)
    t.hold("r", [np.arange(2)], readers=1, ttl_s=5)
    with pytest.raises(AlreadyExists):
        t.hold("r", [np.arange(2)], readers=1, ttl_s=5)
    with pytest.raises(InvalidRequest):
        t.confirm("r", "a", 0)


def test_callback_errors_do_not_break_the_table(table: tuple[LeaseTable, list[Released]]) -> None:
    t, seen = table

    def boom(_: Released) -> None:
        raise RuntimeError("callback bug")

    t.subscribe(boom)
    t.hold("r", [np.arange(2)], readers=1, ttl_s=5)
    assert t.notified("r", t.confirm("r", "a", 1).ticket)
    assert len(seen) == 1 and len(t) == 0


_OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["confirm", "notify", "finish", "renew", "advance", "cancel", "forge", "decline"]
        ),
        st.sampled_from(["a", "b", "c"]),
        st.floats(0.1, 3.0),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(readers=st.integers(1, 3), ops=_OPS)
def test_blocks_are_never_released_while_a_share_is_reading(
    readers: int, ops: list[tuple[str, str, float]]
) -> None:
    """Whatever readers, third parties, the owner and time do, the lease ends at most once
    and never while a confirmed reader's share is valid and unfinished."""
    clock = Clock()
    t = LeaseTable(clock=clock)
    seen: list[Released] = []
    reading: dict[str, tuple[int, float]] = {}  # reader -> (ticket, expiry) while reading

    def check(_: Released) -> None:
        live = [r for r, (_, exp) in reading.items() if exp > clock.now]
        assert not live, f"released while {live} still reading"

    t.subscribe(check)
    t.subscribe(seen.append)
    t.hold("r", [np.arange(4)], readers=readers, ttl_s=10)
    for op, who, x in ops:
        try:
            if op == "confirm":
                v = t.confirm("r", who, x)
                reading[who] = (v.ticket, v.expires_at)
            elif op == "notify" and who in reading:
                t.notified("r", reading.pop(who)[0])
            elif op == "finish":
                t.finish("r", who, done=x > 1)
                reading.pop(who, None)
            elif op == "renew":
                if not t.renew(who, ["r"], x) and who in reading:
                    reading[who] = (reading[who][0], max(reading[who][1], clock.now + x))
            elif op == "advance":
                clock.now += x
                reading = {r: v for r, v in reading.items() if v[1] > clock.now}
                t.reap()
            elif op == "cancel":
                t.cancel("r")
            elif op == "forge":
                assert not t.notified("r", int(x * 1000))
            elif op == "decline":  # a reader still reading ends its own share by declining
                t.decline("r", who)
                reading.pop(who, None)
        except (LeaseRefused, NotFound, PermissionDenied):
            pass
    assert len(seen) <= 1


def test_a_decline_takes_one_place_without_reading(
    table: tuple[LeaseTable, list[Released]],
) -> None:
    """DeclineLease (peer.proto): a reader that will not read gives its place up; the blocks
    are released once no other expected reader is left, and only then."""
    t, seen = table
    t.hold("r", [np.arange(4)], readers=2, ttl_s=30)
    a = t.confirm("r", "reader-a", 10).ticket
    view, released = t.decline("r", "reader-b")
    assert not released and seen == [] and view.confirmations == 2 and view.ticket == 0
    assert t.decline("r", "reader-b") == (view, False)  # idempotent
    with pytest.raises(LeaseRefused, match="all of them have confirmed"):
        t.confirm("r", "reader-c", 10)  # the declined place is taken
    with pytest.raises(LeaseRefused, match="confirmed \\(or declined\\)"):
        t.decline("r", "reader-c")
    assert t.notified("r", a)
    [rel] = seen
    assert rel.reason is ReleaseReason.CANCELLED and rel.readers_done == 1
    # Released since: nothing is held for reader-b, which is all a decline asks.
    assert t.decline("r", "reader-b") == (LeaseView("r", 0, 0, 0, 0.0), True)
    assert len(seen) == 1
    with pytest.raises(NotFound):
        t.decline("never-held", "reader-b")


def test_a_decline_of_a_lease_that_lapsed_at_its_ttl_is_answered_released(
    table: tuple[LeaseTable, list[Released]], clock: Clock
) -> None:
    """A helper's review: a decline of a lease that lapsed was refused with the wording of a
    missing lease ("do not read: re-run the prefill"), though its goal was met."""
    t, seen = table
    t.hold("lapsed", [np.arange(2)], readers=1, ttl_s=5)
    t.hold("reaped", [np.arange(2)], readers=2, ttl_s=5)
    clock.now += 6
    # Past its TTL, not reaped yet: the decline ends it (once), and is answered released.
    assert t.decline("lapsed", "reader-a") == (LeaseView("lapsed", 0, 0, 0, 0.0), True)
    assert [(r.request_id, r.reason) for r in seen] == [("lapsed", ReleaseReason.EXPIRED)]
    assert [r.request_id for r in t.reap()] == ["reaped"]
    view, released = t.decline("reaped", "reader-a")
    assert released and view.readers == view.confirmations == 0
    assert [r.request_id for r in seen] == ["lapsed", "reaped"]  # nothing released twice


def test_a_decline_after_the_other_readers_ended_the_lease_is_answered_released(
    table: tuple[LeaseTable, list[Released]],
) -> None:
    t, seen = table
    t.hold("r", [np.arange(2)], readers=1, ttl_s=30)
    assert t.notified("r", t.confirm("r", "reader-a", 10).ticket)  # reader-a took the place
    [rel] = seen
    assert rel.reason is ReleaseReason.DONE
    view, released = t.decline("r", "reader-b")  # reader-b never read
    assert released and view == LeaseView("r", 0, 0, 0, 0.0) and len(seen) == 1


def test_a_decline_of_a_request_never_held_or_forgotten_is_still_refused(clock: Clock) -> None:
    t = LeaseTable(clock=clock, remember_released=1)
    with pytest.raises(NotFound) as never:
        t.decline("never-held", "reader-a")
    assert "not held here" in never.value.message and "Hold" in never.value.fix
    for rid in ("old", "new"):
        t.hold(rid, [np.arange(2)], readers=1, ttl_s=30)
        t.cancel(rid)
    assert t.decline("new", "reader-a")[1]  # remembered
    with pytest.raises(NotFound):
        t.decline("old", "reader-a")  # forgotten: refused as never held


def test_a_decline_of_the_only_place_releases_at_once_and_a_reader_that_read_cannot_decline(
    table: tuple[LeaseTable, list[Released]],
) -> None:
    t, seen = table
    t.hold("one", [np.arange(2)], readers=1, ttl_s=30)
    assert t.decline("one", "reader-a")[1]
    assert [r.reason for r in seen] == [ReleaseReason.CANCELLED]
    t.hold("two", [np.arange(2)], readers=2, ttl_s=30)
    assert t.notified("two", t.confirm("two", "reader-a", 10).ticket)
    with pytest.raises(LeaseRefused, match="already ended \\(DONE\\)"):
        t.decline("two", "reader-a")
    t.confirm("two", "reader-b", 10)
    _, released = t.decline("two", "reader-b")  # a confirmed reader declining gives up
    assert released and seen[-1].reason is ReleaseReason.CANCELLED


def test_hold_refusals_name_the_wire_field_and_say_how_to_fix_them(
    table: tuple[LeaseTable, list[Released]],
) -> None:
    t, _ = table
    with pytest.raises(InvalidRequest) as err:
        t.hold("r", [np.array([1])], readers=1, ttl_s=4294967.295)  # HoldRequest.ttl_ms
    assert err.value.field == "ttl_ms" and "4294967295 ms" in err.value.message
    assert str(int(t.max_ttl_s * 1000)) in err.value.fix
    t.hold("r", [np.array([1])], readers=1, ttl_s=5)
    with pytest.raises(AlreadyExists) as dup:
        t.hold("r", [np.array([1])], readers=1, ttl_s=5)
    assert dup.value.field == "request_id" and "new request its own ID" in dup.value.fix


def test_reading_left_is_the_last_reading_shares_time_to_expiry(
    clock: Clock, table: tuple[LeaseTable, list[Released]]
) -> None:
    # What an engine's detach keeps the pool mapped for (kvxferd/daemon/attach.py): only shares
    # still READING count; ENGINE_DETACHED lapses them, so it is asked before that cancel.
    t, _ = table
    t.hold("a", [np.arange(2)], readers=2, ttl_s=30)
    t.hold("b", [np.arange(2)], readers=1, ttl_s=30)
    assert t.reading_left(["a", "b", "gone"]) == 0.0  # held, nobody confirmed
    t.confirm("a", "r1", 4)
    clock.now += 1
    t.confirm("a", "r2", 6)
    b = t.confirm("b", "r1", 9).ticket
    assert t.reading_left(["a"]) == pytest.approx(6)
    assert t.reading_left(["a", "b"]) == pytest.approx(9)
    assert t.notified("b", b)  # read: no longer trusted by anyone
    assert t.reading_left(["a", "b"]) == pytest.approx(6)
    clock.now += 7  # every share past its expiry
    assert t.reading_left(["a"]) == 0.0
    t.hold("c", [np.arange(2)], readers=1, ttl_s=30)
    t.confirm("c", "r1", 5)
    assert t.reading_left(["c"]) == pytest.approx(5)
    t.cancel("c", ReleaseReason.ENGINE_DETACHED)
    assert t.reading_left(["c"]) == 0.0
