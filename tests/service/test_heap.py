"""kvxferd/service/heap.py: while the daemon serves, the objects alive at its start are frozen
out of the collector; after, they are not (the interpreter's shutdown sees the usual heap)."""

from __future__ import annotations

import gc

from kvxferd.service.heap import serving_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_start_up_objects_are_frozen_while_serving_and_released_after() -> None:
    # Python 3.12 starts with a few hundred objects of its own in the permanent generation.
    before = gc.get_freeze_count()
    kept = _Cycle()
    with serving_heap() as frozen:
        assert frozen > before and gc.get_freeze_count() > before
        assert all(o is not kept for o in gc.get_objects())  # out of the collector's generations
        later = _Cycle()  # made while serving: collected as usual
        assert any(o is later for o in gc.get_objects())
    assert gc.get_freeze_count() == 0
    assert any(o is kept for o in gc.get_objects())
