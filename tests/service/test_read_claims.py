"""kvxferd/daemon/claims.py: at most one pull of a daemon reads an owner's request at a time,
and none after one ended its share (for a while), as the module's docstring says."""

from __future__ import annotations

import asyncio

import pytest

from kvxferd.daemon.claims import DECLINE_CLAIM, ReadClaims
from kvxferd.errors import DeadlineExceeded, LeaseRefused


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_second_pull_of_a_request_being_read_is_refused_naming_the_first() -> None:
    claims = ReadClaims()
    assert claims.claim("owner:1", "r", "A")
    with pytest.raises(LeaseRefused) as err:
        claims.claim("owner:1", "r", "B")
    assert "'A'" in err.value.message and err.value.field == "request_id"
    assert "wait for transfer A" in err.value.fix
    # Another request, or the same request of another owner (another share), is free.
    assert claims.claim("owner:1", "s", "C")
    assert claims.claim("owner:2", "r", "D")


def test_a_twin_of_the_same_transfer_is_told_so_not_refused() -> None:
    claims = ReadClaims()
    assert claims.claim("owner:1", "r", "A")
    assert claims.claim("owner:1", "r", "A") is False  # the twin waits for A's pull
    assert claims.reading("owner:1", "r") == "A"


def test_a_pull_that_keeps_its_share_frees_the_request_at_once() -> None:
    claims = ReadClaims()
    claims.claim("owner:1", "r", "A")
    claims.release("owner:1", "r", "A", ended=False)  # FAILED or EXPIRED: a retry may read
    assert claims.reading("owner:1", "r") is None
    assert claims.claim("owner:1", "r", "B")


def test_a_pull_that_ended_its_share_refuses_later_pulls_until_the_ttl() -> None:
    clock = Clock()
    claims = ReadClaims(ended_ttl_s=60.0, clock=clock)
    claims.claim("owner:1", "r", "A")
    claims.release("owner:1", "r", "A", ended=True)
    with pytest.raises(LeaseRefused) as err:
        claims.claim("owner:1", "r", "B")
    assert "'A'" in err.value.message and "already ended its share" in err.value.message
    assert err.value.fix
    clock.t += 59.0
    with pytest.raises(LeaseRefused):
        claims.claim("owner:1", "r", "B")
    clock.t += 2.0  # past the TTL: the owner refuses a second read itself from now on
    assert claims.claim("owner:1", "r", "B")


def test_only_the_claiming_pull_releases_its_claim() -> None:
    claims = ReadClaims()
    claims.claim("owner:1", "r", "A")
    claims.release("owner:1", "r", "B", ended=True)  # not B's: nothing changes
    assert claims.reading("owner:1", "r") == "A"
    with pytest.raises(LeaseRefused) as err:
        claims.claim("owner:1", "r", "C")
    assert "being read by transfer 'A'" in err.value.message


def test_ended_requests_expire_in_order_and_do_not_accumulate() -> None:
    clock = Clock()
    claims = ReadClaims(ended_ttl_s=10.0, clock=clock)
    for i in range(1000):
        claims.claim("owner:1", f"r{i}", f"t{i}")
        claims.release("owner:1", f"r{i}", f"t{i}", ended=True)
        clock.t += 0.1  # 100 s in all: all but the last ~100 have expired
    assert claims.ended <= 101


def test_a_twin_waits_for_its_pull_to_start_or_for_the_claim_to_go() -> None:
    clock = Clock()
    claims = ReadClaims(clock=clock)
    claims.claim("owner:1", "r", "A")
    started: list[bool] = []

    async def go() -> None:
        waiting = asyncio.ensure_future(
            claims.twin("owner:1", "r", "A", lambda: bool(started), deadline=clock.t + 5)
        )
        await asyncio.sleep(0.01)
        assert not waiting.done()
        started.append(True)  # the twin's pull exists now
        await asyncio.wait_for(waiting, 1)
        # Or its claim goes (the twin gave up before its pull existed).
        started.clear()
        waiting = asyncio.ensure_future(
            claims.twin("owner:1", "r", "A", lambda: False, clock.t + 5)
        )
        await asyncio.sleep(0.01)
        claims.release("owner:1", "r", "A", ended=False)
        await asyncio.wait_for(waiting, 1)
        claims.claim("owner:1", "r", "A")
        with pytest.raises(DeadlineExceeded):  # and never past the pull's deadline
            await claims.twin("owner:1", "r", "A", lambda: False, deadline=clock.t - 1)

    asyncio.run(go())


def test_a_decline_is_refused_while_a_pull_reads_and_refuses_pulls_after_it() -> None:
    """kvxferd/daemon/decline.py takes the request's claim like a pull: never under a pull
    still reading (the owner would free the blocks under its READ), and a later pull of a
    declined request is refused naming the decline."""
    claims = ReadClaims()
    assert claims.claim("owner:1", "r", "A")
    with pytest.raises(LeaseRefused, match="transfer 'A'"):
        claims.claim("owner:1", "r", DECLINE_CLAIM)
    claims.release("owner:1", "r", "A", ended=False)  # failed: kept its share
    assert claims.claim("owner:1", "r", DECLINE_CLAIM)
    with pytest.raises(LeaseRefused, match="being declined"):
        claims.claim("owner:1", "r", "B")
    claims.release("owner:1", "r", DECLINE_CLAIM, ended=True)
    assert claims.ended_by("owner:1", "r") == DECLINE_CLAIM
    with pytest.raises(LeaseRefused, match="declined") as err:
        claims.claim("owner:1", "r", "B")
    assert "under a new request ID" in err.value.fix
