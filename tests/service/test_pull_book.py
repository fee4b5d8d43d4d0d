"""The book of pulls (kvxferd/daemon/pulls.py): a record is revised as dataclasses.replace
would, each change bumps the revision, a terminal state is stamped, wakes its waiters and is
final, and watchers hear every change."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvxferd.daemon.pulls import PullBook, PullRecord, PullState, revised
from kvxferd.errors import KvxferdError


def _rec(tid: str = "t1") -> PullRecord:
    return PullRecord(transfer_id=tid, request_id="r1", peer_address="127.0.0.1:1", nbytes=64)


def test_revised_is_dataclasses_replace() -> None:
    rec = _rec()
    changes: dict[str, object] = {
        "state": PullState.TRANSFERRING,
        "posted_descriptors": 3,
        "error": KvxferdError("x"),
        "stages": (("plan", 0.1),),
    }
    got = revised(rec, dict(changes))
    want = dataclasses.replace(rec, **changes)  # type: ignore[arg-type]
    assert got == want and type(got) is PullRecord
    assert rec.state is PullState.PENDING  # the old record is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.nbytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError, match="no field bogus"):
        revised(rec, {"bogus": 1})


def test_updates_bump_the_revision_and_a_terminal_state_is_final() -> None:
    async def run() -> None:
        book = PullBook()
        q = book.watch(frozenset())
        added = book.add(_rec())
        assert added.revision == 1 and added.created_ns > 0 and added.finished_ns == 0
        waiter = asyncio.ensure_future(book.wait_terminal("t1"))
        moving = book.update("t1", state=PullState.TRANSFERRING)
        assert moving.revision == 2 and moving.finished_ns == 0 and book.num_active == 1
        await asyncio.sleep(0)
        assert not waiter.done()
        done = book.update("t1", state=PullState.DONE, posted_descriptors=5)
        assert done.revision == 3 and done.finished_ns >= added.created_ns
        assert (await waiter) is done and book.num_active == 0
        assert book.update("t1", state=PullState.FAILED) is done  # terminal is final
        heard = [await q.get() for _ in range(len(q))]
        assert [r.revision for r in heard] == [1, 2, 3]

    asyncio.run(run())


def test_end_listeners_hear_each_pull_once_after_its_waiters() -> None:
    """A listener (the pull metrics) hears every pull's terminal record once, and only after
    the callbacks its ending scheduled: a StartPull ``wait`` has its answer first."""

    async def run() -> None:
        book = PullBook()
        order: list[str] = []
        book.on_end(lambda rec: order.append(f"ended {rec.transfer_id} {rec.state.value}"))

        async def waiter(tid: str) -> None:
            rec = await book.wait_terminal(tid)
            order.append(f"answered {rec.transfer_id}")

        for tid in ("a", "b"):
            book.add(_rec(tid))
        waits = [asyncio.ensure_future(waiter(t)) for t in ("a", "b")]
        await asyncio.sleep(0)  # both waiting
        book.update("a", state=PullState.TRANSFERRING)
        await asyncio.sleep(0)
        assert order == []  # not terminal: nothing heard
        book.update("a", state=PullState.DONE)
        book.update("b", state=PullState.FAILED, error=KvxferdError("x"))
        book.update("a", state=PullState.FAILED)  # terminal is final: no second end
        await asyncio.gather(*waits)
        await asyncio.sleep(0)
        assert order == ["answered a", "ended a DONE", "answered b", "ended b FAILED"]

    asyncio.run(run())


def test_end_listeners_without_a_loop_are_called_at_once() -> None:
    book = PullBook()
    heard: list[PullRecord] = []
    book.on_end(heard.append)
    book.add(_rec())
    done = book.update("t1", state=PullState.CANCELLED)
    assert heard == [done]
