"""The reader's check of a lease confirmation (kvxferd/daemon/shares.py ``_missing``): the
requested remote IDs the owner does not hold, sorted, whatever the sizes and orders."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.daemon.shares import _missing
from kvxferd.wire.codec import group_ids_to_proto


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, 5000), min_size=0, max_size=700, unique=True),
    drop=st.integers(0, 20),
    extra=st.lists(st.integers(5001, 9000), max_size=5, unique=True),
    shuffle=st.booleans(),
)
def test_missing_is_the_sorted_set_difference(
    ids: list[int], drop: int, extra: list[int], shuffle: bool
) -> None:
    held = ids[drop:] + extra
    if shuffle:
        held = held[::-1]
    got = _missing(np.array(ids, dtype=np.int64), held)
    assert got.dtype == np.int64
    assert got.tolist() == sorted(set(ids) - set(held))


def test_a_large_request_held_exactly_has_nothing_missing() -> None:
    ids = np.arange(1000, dtype=np.int64)[::-1].copy()
    assert _missing(ids, ids.tolist()).size == 0
    assert _missing(ids, ids[:-1].tolist()).tolist() == [0]


@given(ids=st.lists(st.integers(0, 5000), max_size=300, unique=True), drop=st.integers(0, 3))
def test_missing_reads_the_answers_repeated_field_as_it_comes(ids: list[int], drop: int) -> None:
    """``held`` as the reader gets it: the ConfirmLease answer's protobuf repeated field (the
    exact, in-order answer takes a shortcut; anything else the set difference)."""
    msg = group_ids_to_proto([ids[drop:]])
    got = _missing(np.array(ids, dtype=np.int64), msg.groups[0].ids)
    assert got.tolist() == sorted(ids[:drop])
