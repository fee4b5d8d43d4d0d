"""Prepared slot-to-slot READs (kvxferd.staging.slot_reads) between this process and a real
owner process over NIXL: each (peer, local slot, owner slot, bytes) is prepared once and posted
under every chunk's own transfer ID, the bytes land exactly, a re-handshake's new regions are
used, and a range outside either ring is refused before anything is posted."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvxferd.errors import BlockRangeError
from kvxferd.scenario.owner import OwnerProcess, OwnerSpec
from kvxferd.scenario.pattern import pattern_words
from kvxferd.staging.slot_reads import SlotReads
from kvxferd.transfer import TransferStatus
from tests.transfer.conftest import BLOCK, REGION, Reader, close_reader, make_reader

RING = 1  # region 1 plays the staging ring on both sides
WORDS = BLOCK // 8


@pytest.fixture(scope="module")
def owner() -> Iterator[OwnerProcess]:
    o = OwnerProcess(OwnerSpec("slot-reads-owner", (REGION, REGION), seed=4))
    yield o
    o.close()


@pytest.fixture
def reader(owner: OwnerProcess) -> Iterator[Reader]:
    r = make_reader()
    r.connect(owner)
    yield r
    close_reader(r)


def _read(reads: SlotReads, owner: OwnerProcess, tid: str, local: int, remote: int) -> None:
    xfer = reads.post(tid, owner.name, local * BLOCK, remote * BLOCK, BLOCK, timeout_s=10.0)
    assert xfer.transfer_id == tid
    res = xfer.result(10)
    assert res.status is TransferStatus.DONE, res.reason
    assert res.descriptors == 1 and res.nbytes == BLOCK


def _holds(r: Reader, owner: OwnerProcess, local: int, remote: int) -> bool:
    got = r.words(RING)[local * WORDS : (local + 1) * WORDS]
    return bool(np.array_equal(got, pattern_words(owner.spec.seed, RING, remote * WORDS, WORDS)))


def _count_prepares(reader: Reader, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The transfer IDs the engine prepares descriptors for (the real method runs)."""
    calls: list[str] = []
    real = reader.engine.prepare

    def prepare(transfer_id: str, *args: Any, **kw: Any) -> Any:
        calls.append(transfer_id)
        return real(transfer_id, *args, **kw)

    monkeypatch.setattr(reader.engine, "prepare", prepare)
    return calls


def test_a_slot_pair_is_prepared_once_and_read_exactly(
    owner: OwnerProcess, reader: Reader, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared = _count_prepares(reader, monkeypatch)
    reads = SlotReads(reader.engine, RING)
    for i, (local, remote) in enumerate([(0, 5), (1, 6), (0, 5), (1, 6), (0, 5)]):
        reader.buffers[RING].zero_()
        _read(reads, owner, f"pull#{i}", local, remote)
        assert _holds(reader, owner, local, remote)
        # Nothing else was written: one slot's bytes only.
        assert np.count_nonzero(reader.words(RING)) <= WORDS
    assert len(reads) == 2 and prepared == ["pull#0", "pull#1"]  # two pairs, once each


def test_a_rehandshake_is_used_and_out_of_ring_ranges_are_refused(
    owner: OwnerProcess, reader: Reader, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared = _count_prepares(reader, monkeypatch)
    reads = SlotReads(reader.engine, RING)
    _read(reads, owner, "before", 2, 3)
    reader.engine.connect_peer(owner.name, owner.metadata, owner.regions)  # a re-handshake
    for tid in ("after", "after-again"):
        reader.buffers[RING].zero_()
        _read(reads, owner, tid, 2, 3)
        assert _holds(reader, owner, 2, 3)
    # The stale entry was prepared again once, against the new regions, and then reused.
    assert prepared == ["before", "after"] and len(reads) == 1
    last = REGION // BLOCK
    with pytest.raises(BlockRangeError):
        reads.post("outside", owner.name, 0, last * BLOCK, BLOCK, timeout_s=10.0)
    with pytest.raises(BlockRangeError):
        reads.post("outside-local", owner.name, last * BLOCK, 0, BLOCK, timeout_s=10.0)
