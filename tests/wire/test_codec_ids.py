"""Block-ID groups on the wire (kvxferd/wire/codec.py): arrays and plain sequences encode to
the same message and decode back to the same int64 arrays."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvxferd.wire.codec import group_ids_from_proto, group_ids_to_proto

groups_st = st.lists(st.lists(st.integers(0, 2**62), max_size=600), max_size=4)


@given(groups=groups_st)
def test_arrays_and_lists_round_trip_to_the_same_message(groups: list[list[int]]) -> None:
    as_arrays = [np.asarray(g, dtype=np.int64) for g in groups]
    msg = group_ids_to_proto(as_arrays)
    assert msg == group_ids_to_proto(groups)
    assert msg == group_ids_to_proto([tuple(g) for g in groups])
    back = group_ids_from_proto(msg)
    assert [b.dtype for b in back] == [np.dtype(np.int64)] * len(groups)
    assert [b.tolist() for b in back] == groups
