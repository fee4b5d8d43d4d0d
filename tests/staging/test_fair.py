"""Units of kvxferd.staging.fair: waiting Gathers served round-robin between readers, FIFO
within one, a reader at its cap skipped until its held count drops."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from kvxferd.staging.fair import FairQueue, Waiter


def _waiters(loop: asyncio.AbstractEventLoop, arrivals: list[int]) -> list[Waiter]:
    return [Waiter(f"req-{i}", f"reader-{r}", loop.create_future()) for i, r in enumerate(arrivals)]


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_pops_go_round_robin_over_readers_and_fifo_within_one(arrivals: list[int]) -> None:
    loop = asyncio.new_event_loop()
    try:
        q = FairQueue(cap=1 << 30, held=lambda reader: 0)
        waiters = _waiters(loop, arrivals)
        for w in waiters:
            q.push(w)
        assert sum(q.counts().values()) == len(waiters)
        served: list[Waiter] = []
        while (w := q.pop_next()) is not None:
            served.append(w)
        assert sorted(id(w) for w in served) == sorted(id(w) for w in waiters)
        for reader in {w.reader for w in waiters}:
            mine = [w.request_id for w in served if w.reader == reader]
            assert mine == [w.request_id for w in waiters if w.reader == reader]  # FIFO
        # Round-robin: while two readers both still wait, neither is served twice in a row
        # of the other's turns (their served counts never differ by more than one).
        left = {r: sum(1 for w in waiters if w.reader == r) for r in {w.reader for w in waiters}}
        got = dict.fromkeys(left, 0)
        for w in served:
            got[w.reader] += 1
            waiting = [r for r in left if got[r] < left[r]]
            if w.reader in waiting:
                assert all(got[w.reader] <= got[r] + 1 for r in waiting), (w.reader, got)
        assert q.counts() == {} and q.eligible() is None
    finally:
        loop.close()


@given(st.lists(st.integers(0, 2), min_size=1, max_size=20), st.integers(0, 2))
def test_a_reader_at_its_cap_is_skipped(arrivals: list[int], capped: int) -> None:
    loop = asyncio.new_event_loop()
    try:
        held = {f"reader-{capped}": 1}
        q = FairQueue(cap=1, held=lambda reader: held.get(reader, 0))
        waiters = _waiters(loop, arrivals)
        for w in waiters:
            q.push(w)
        served = []
        while (w := q.pop_next()) is not None:
            served.append(w)
        assert all(w.reader != f"reader-{capped}" for w in served)
        skipped = [w for w in waiters if w.reader == f"reader-{capped}"]
        assert q.of(f"reader-{capped}") == skipped
        held.clear()  # its slot came back: now it is served, oldest first
        assert [q.pop_next() for _ in skipped] == skipped
    finally:
        loop.close()


def test_removed_and_cancelled_waiters_are_never_served() -> None:
    loop = asyncio.new_event_loop()
    try:
        q = FairQueue(cap=4, held=lambda reader: 0)
        a, b, c = _waiters(loop, [0, 0, 1])
        for w in (a, b, c):
            q.push(w)
        q.remove(c)
        a.fut.cancel()
        assert q.pop_next() is b
        assert q.pop_next() is None and q.all() == []
    finally:
        loop.close()
