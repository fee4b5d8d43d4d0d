"""Real NIXL agents over UCX on loopback: an owner process, readers in this process."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvxferd.blocks.ranges import TransferPlan
from kvxferd.errors import LeaseRefused, PeerUnavailable, ResourceExhausted
from kvxferd.scenario.naive import per_block_plan
from kvxferd.scenario.owner import OwnerProcess, OwnerSpec
from kvxferd.scenario.pattern import pattern_words
from kvxferd.transfer import EngineOptions, TransferStatus, notify
from tests.transfer.conftest import BLOCK, REGION, Reader, close_reader, make_reader

WORDS = BLOCK // 8


def _check_blocks(r: Reader, seed: int, local: np.ndarray, remote: np.ndarray) -> None:
    for region in range(len(r.buffers)):
        got = r.words(region)
        for lb, rb in zip(local.tolist(), remote.tolist(), strict=True):
            want = pattern_words(seed, region, rb * WORDS, WORDS)
            assert np.array_equal(got[lb * WORDS : (lb + 1) * WORDS], want), (region, lb, rb)


def _clear(r: Reader) -> None:
    for b in r.buffers:
        b.zero_()


def test_contiguous_read_moves_exact_bytes_in_one_descriptor_per_region(
    owner: OwnerProcess, reader: Reader
) -> None:
    _clear(reader)
    local, remote = np.arange(10, 74), np.arange(100, 164)
    plan = per_block_plan(local, remote, num_layers=2, block_bytes=BLOCK)
    res = reader.engine.submit("contig", owner.name, plan).result(10)
    assert res.status is TransferStatus.DONE, res.reason
    assert res.descriptors == 2 and res.nbytes == 2 * 64 * BLOCK
    assert res.invalid_blocks == ()
    _check_blocks(reader, 1, local, remote)
    # Nothing outside the written blocks was touched.
    assert not reader.words(0)[: 10 * WORDS].any() and not reader.words(1)[74 * WORDS :].any()


def test_a_read_reports_when_its_post_began_was_accepted_and_ended(
    owner: OwnerProcess, reader: Reader
) -> None:
    """The data plane's clock (TransferResult: post_started_at, posted_at, completed_at; the
    decode daemon's started_unix_ns is the first): in order, after the submit, on the
    engine's monotonic clock; a transfer with nothing to read was never posted."""
    local, remote = np.arange(0, 8), np.arange(8, 16)
    plan = per_block_plan(local, remote, num_layers=2, block_bytes=BLOCK)
    t0 = time.monotonic()
    res = reader.engine.submit("clock", owner.name, plan).result(10)
    t1 = time.monotonic()
    assert res.status is TransferStatus.DONE, res.reason
    assert t0 <= res.post_started_at <= res.posted_at <= res.completed_at <= t1
    empty = reader.engine.submit("clock-empty", owner.name, TransferPlan(())).result(5)
    assert empty.status is TransferStatus.DONE
    assert empty.post_started_at == empty.posted_at == 0.0


def test_fragmented_read_moves_exact_bytes(owner: OwnerProcess, reader: Reader) -> None:
    _clear(reader)
    rng = np.random.default_rng(7)
    n = REGION // BLOCK
    local = rng.choice(n, 80, replace=False)
    remote = rng.choice(n, 80, replace=False)
    plan = per_block_plan(local, remote, num_layers=2, block_bytes=BLOCK)
    res = reader.engine.submit("frag", owner.name, plan).result(10)
    assert res.status is TransferStatus.DONE, res.reason
    assert res.descriptors > 100
    if res.nixl_descriptors is not None:
        assert res.nixl_descriptors == res.descriptors
    _check_blocks(reader, 1, local, remote)


def test_empty_plan_is_done_and_still_notifies(owner: OwnerProcess, reader: Reader) -> None:
    owner.call("hold", "empty-1", 1, 10.0)
    ticket = owner.call("confirm", "empty-1", "reader-a")
    before = len(owner.call("released"))
    res = reader.engine.submit(
        "empty", owner.name, TransferPlan(()), notif=notify.encode("empty-1", ticket)
    ).result(5)
    assert res.status is TransferStatus.DONE and res.nbytes == 0
    rel = owner.wait_released(before + 1)
    assert ("empty-1", "DONE", 1) in rel


def test_two_readers_release_the_lease_once(owner: OwnerProcess, reader: Reader) -> None:
    second = make_reader()
    try:
        second.connect(owner)
        owner.call("hold", "two-1", 2, 10.0)
        plan = per_block_plan(np.arange(4), np.arange(4), num_layers=2, block_bytes=BLOCK)
        t1 = owner.call("confirm", "two-1", "reader-a")
        note1 = notify.encode("two-1", t1)
        r1 = reader.engine.submit("two-a", owner.name, plan, notif=note1)
        assert r1.result(10).status is TransferStatus.DONE
        # The same notification again (a replay) counts once.
        reader.engine.submit("two-a2", owner.name, TransferPlan(()), notif=note1).result(5)
        time.sleep(0.1)
        assert not [x for x in owner.call("released") if x[0] == "two-1"]
        t2 = owner.call("confirm", "two-1", "reader-b")
        r2 = second.engine.submit("two-b", owner.name, plan, notif=notify.encode("two-1", t2))
        assert r2.result(10).status is TransferStatus.DONE
        owner.wait_released(1_000, timeout_s=0.5)  # let any duplicate arrive
        assert [x for x in owner.call("released") if x[0] == "two-1"] == [("two-1", "DONE", 2)]
    finally:
        close_reader(second)


def test_forged_notifications_never_release_a_lease(owner: OwnerProcess, reader: Reader) -> None:
    """A peer that never confirmed (or guesses a ticket) sends READ_DONE over real NIXL: the
    lease stays held for the reader that did confirm, and each forgery is counted as stray."""
    owner.call("hold", "forge-1", 1, 10.0)
    ticket = owner.call("confirm", "forge-1", "reader-a")
    stray = owner.call("stray")
    for i, forged in enumerate((1, ticket ^ 0x10, 2**63 - 1)):
        done = reader.engine.submit(
            f"forge-{i}", owner.name, TransferPlan(()), notif=notify.encode("forge-1", forged)
        ).result(5)
        assert done.status is TransferStatus.DONE
    deadline = time.monotonic() + 5
    while owner.call("stray") < stray + 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert owner.call("stray") == stray + 3
    assert not [x for x in owner.call("released") if x[0] == "forge-1"]
    reader.engine.submit(
        "forge-ok", owner.name, TransferPlan(()), notif=notify.encode("forge-1", ticket)
    ).result(5)
    deadline = time.monotonic() + 5
    while not [x for x in owner.call("released") if x[0] == "forge-1"]:
        assert time.monotonic() < deadline, "the confirmed reader's notification was ignored"
        time.sleep(0.02)
    assert [x for x in owner.call("released") if x[0] == "forge-1"] == [("forge-1", "DONE", 1)]


def test_lease_expiring_before_confirm_is_refused(owner: OwnerProcess) -> None:
    owner.call("hold", "exp-1", 1, 0.2)
    time.sleep(0.3)
    with pytest.raises(LeaseRefused):
        owner.call("confirm", "exp-1", "reader-a")
    assert ("exp-1", "EXPIRED", 0) in owner.call("released")


def test_per_peer_byte_budget_fails_fast(owner: OwnerProcess) -> None:
    r = make_reader(options=EngineOptions(max_inflight_bytes_per_peer=3 * BLOCK))
    try:
        r.connect(owner)
        owner.stop_signal()  # keep the first transfer in flight
        try:
            plan = per_block_plan(np.arange(2), np.arange(2), num_layers=1, block_bytes=BLOCK)
            first = r.engine.submit("b1", owner.name, plan, timeout_s=2)
            with pytest.raises(ResourceExhausted):
                r.engine.submit("b2", owner.name, plan, timeout_s=2)
            assert r.engine.cancel("b1").result(5) is True
            assert first.result(5).status is TransferStatus.CANCELLED
        finally:
            owner.cont_signal()
        assert r.engine.inflight_bytes(owner.name) == 0
        assert r.engine.submit("b3", owner.name, plan).result(10).status is TransferStatus.DONE
    finally:
        close_reader(r)


def _stopped_owner_and_fresh_reader(
    spawn_owner: type[OwnerProcess], name: str
) -> tuple[OwnerProcess, Reader]:
    """An owner stopped before any reader contacted it: UCX cannot finish connecting, so a READ
    stays in progress. (Against a peer already connected, CPU reads go through CMA, which the
    kernel serves even from a stopped process: those complete.)"""
    victim = spawn_owner(OwnerSpec(name, (REGION,), seed=5))
    victim.stop_signal()
    r = make_reader(num_regions=1)
    r.engine.connect_peer(victim.name, victim.metadata, victim.regions)
    return victim, r


def test_stopped_owner_expires_at_the_deadline(
    spawn_owner: type[OwnerProcess],
) -> None:
    victim, r = _stopped_owner_and_fresh_reader(spawn_owner, "stopped")
    try:
        plan = per_block_plan(
            np.arange(0, 40, 2), np.arange(0, 40, 2), num_layers=1, block_bytes=BLOCK
        )
        t0 = time.monotonic()
        res = r.engine.submit("stuck", victim.name, plan, timeout_s=0.5).result(5)
        took = time.monotonic() - t0
        assert res.status is TransferStatus.EXPIRED, res.reason
        assert 0.45 <= took < 1.5
        assert res.invalid_blocks[0].tolist() == list(range(0, 40, 2))
        assert r.engine.inflight_bytes(victim.name) == 0
        assert r.engine.unreleased_handles == 0  # the stuck handle was released (cancelled)
        victim.cont_signal()  # resumed: the same peer serves the next transfer
        res2 = r.engine.submit("after", victim.name, plan, timeout_s=10).result(15)
        assert res2.status is TransferStatus.DONE, res2.reason
        assert np.array_equal(r.words(0)[:WORDS], pattern_words(5, 0, 0, WORDS))
    finally:
        close_reader(r)


def test_killed_owner_fails_in_deadline_and_can_be_replaced(
    owner: OwnerProcess, reader: Reader, spawn_owner: type[OwnerProcess]
) -> None:
    reborn = spawn_owner(OwnerSpec("victim", (REGION,), seed=9), wait=False)  # starts early
    victim, r = _stopped_owner_and_fresh_reader(spawn_owner, "victim")
    try:
        plan = per_block_plan(
            np.arange(0, 40, 2), np.arange(0, 40, 2), num_layers=1, block_bytes=BLOCK
        )
        t0 = time.monotonic()
        doomed = r.engine.submit("v-doomed", "victim", plan, timeout_s=5.0)
        time.sleep(0.1)
        assert doomed.status is TransferStatus.IN_PROGRESS
        victim.kill()
        res = doomed.result(10)
        took = time.monotonic() - t0
        assert res.status is TransferStatus.FAILED, res.reason
        assert isinstance(res.error, PeerUnavailable)
        assert took < 2.0  # UCX reports the dead peer in tens of ms, well before the deadline
        assert res.invalid_blocks[0].tolist() == list(range(0, 40, 2))
        assert r.engine.unreleased_handles == 0 and r.engine.inflight_bytes("victim") == 0
        # Others keep working meanwhile.
        other = per_block_plan(np.arange(4), np.arange(4), num_layers=2, block_bytes=BLOCK)
        assert (
            reader.engine.submit("o-ok", owner.name, other).result(10).status is TransferStatus.DONE
        )
        # A restarted peer with the same name is re-added from its new metadata.
        r.connect(reborn.ready())
        _clear(r)
        res3 = r.engine.submit("v-new", "victim", plan).result(10)
        assert res3.status is TransferStatus.DONE, res3.reason
        assert np.array_equal(r.words(0)[:WORDS], pattern_words(9, 0, 0, WORDS))
    finally:
        close_reader(r)


def test_unknown_peer_is_refused(reader: Reader) -> None:
    with pytest.raises(PeerUnavailable):
        reader.engine.submit("nope", "no-such-peer", TransferPlan(()))


def test_release_on_done_leaves_no_handles(reader: Reader, owner: OwnerProcess) -> None:
    plan = per_block_plan(np.arange(3), np.arange(3), num_layers=1, block_bytes=BLOCK)
    ts = [reader.engine.submit(f"many-{i}", owner.name, plan) for i in range(20)]
    assert all(t.result(10).status is TransferStatus.DONE for t in ts)
    assert reader.engine.inflight_bytes(owner.name) == 0
    assert reader.engine.unreleased_handles == 0  # every handle was freed by NIXL
    assert torch.equal(reader.buffers[0][:0], reader.buffers[0][:0])
