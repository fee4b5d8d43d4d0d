"""How a read's end is judged against its lease share (kvxferd/daemon/shares.py, ``outcome``):
docs/reliability.md, "a reader whose share lapsed or was reported lost cancels its READ and
fails the pull listing every block"; scheduler.proto, CANCELLED is "Cancelled by
CancelTransfer or shutdown"."""

from __future__ import annotations

import time

import numpy as np

from kvxferd.daemon.pulls import PullState
from kvxferd.daemon.shares import Share, outcome
from kvxferd.errors import Cancelled, LeaseRefused
from kvxferd.transfer import TransferResult, TransferStatus

LOCAL = (np.array([3, 4, 5], dtype=np.int64),)


def _share(*, lost: bool = False, valid_for_s: float = 60.0) -> Share:
    return Share(ticket=7, valid_until=time.monotonic() + valid_for_s, address="owner:1", lost=lost)


def _result(status: TransferStatus) -> TransferResult:
    err = None if status is TransferStatus.DONE else Cancelled("cancelled during the copy")
    return TransferResult.ended(
        "t", "agent", status, err, LOCAL, nbytes=1, descriptors=1, elapsed_s=0
    )


def test_a_read_the_heartbeat_stopped_for_a_lost_share_fails_listing_every_block() -> None:
    state, err, invalid = outcome(
        _result(TransferStatus.CANCELLED), _share(lost=True), LOCAL, "owner:1", False
    )
    assert state is PullState.FAILED
    assert isinstance(err, LeaseRefused) and err.fix and "owner:1" in err.message
    assert [b.tolist() for b in invalid] == [[3, 4, 5]]


def test_a_read_a_caller_cancelled_stays_cancelled_even_if_the_share_was_lost_meanwhile() -> None:
    state, err, _ = outcome(
        _result(TransferStatus.CANCELLED), _share(lost=True), LOCAL, "owner:1", True
    )
    assert state is PullState.CANCELLED and isinstance(err, Cancelled)


def test_a_read_that_ended_done_after_its_share_lapsed_or_was_lost_fails() -> None:
    for share in (_share(lost=True), _share(valid_for_s=-1.0)):
        state, err, invalid = outcome(_result(TransferStatus.DONE), share, LOCAL, "owner:1", False)
        assert state is PullState.FAILED and isinstance(err, LeaseRefused)
        assert [b.tolist() for b in invalid] == [[3, 4, 5]]


def test_a_read_within_its_share_ends_as_it_ended() -> None:
    state, err, invalid = outcome(_result(TransferStatus.DONE), _share(), LOCAL, "owner:1", False)
    assert (state, err, invalid) == (PullState.DONE, None, ())
    state, err, invalid = outcome(
        _result(TransferStatus.CANCELLED), _share(), LOCAL, "owner:1", True
    )
    assert state is PullState.CANCELLED and isinstance(err, Cancelled)
    assert [b.tolist() for b in invalid] == [[3, 4, 5]]
