"""Short lists take Python-int paths (``SMALL_IDS``, ``SMALL_PAIRS``): a pull of a few dozen
blocks is cheaper without a dozen NumPy calls. Each path must give exactly what the vectorised
form gives, valid or not: the same arrays, the same error, field and message."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from blocks_helpers import PROPS
from hypothesis import given
from hypothesis import strategies as st

import kvxferd.blocks.plan as plan_mod
from kvxferd.blocks import bounds, check_block_ids, find_runs
from kvxferd.errors import KvxferdError

# kvxferd.blocks re-exports the function coalesce under the module's name
coalesce = importlib.import_module("kvxferd.blocks.coalesce")
F = "groups[0].local_block_ids"
ids_lists = st.lists(st.integers(-3, 80), max_size=70)


def _outcome(ids: list[int], num_blocks: int) -> tuple[str, object]:
    try:
        return "ok", check_block_ids(np.array(ids, dtype=np.int64), num_blocks, F).tolist()
    except KvxferdError as err:
        return type(err).__name__, (err.field, err.message, err.fix)


@PROPS
@given(ids=ids_lists, num_blocks=st.integers(0, 80))
def test_check_block_ids_small_path_agrees(ids: list[int], num_blocks: int) -> None:
    small = _outcome(ids, num_blocks)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bounds, "SMALL_IDS", 0)
        vectorised = _outcome(ids, num_blocks)
    assert small == vectorised


def test_check_block_ids_small_path_refuses_what_it_must() -> None:
    """The Python-int path only lets valid lists through; each fault is still named."""
    for ids, field in (([0, 8], f"{F}[1]"), ([-1, 2], f"{F}[0]"), ([3, 4, 3], f"{F}[2]")):
        with pytest.raises(KvxferdError) as e:
            check_block_ids(ids, 8, F)
        assert e.value.field == field


pairs = st.integers(0, 70).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 90), min_size=n, max_size=n),
        st.lists(st.integers(0, 90), min_size=n, max_size=n),
    )
)


@PROPS
@given(pair=pairs)
def test_find_runs_small_path_agrees(pair: tuple[list[int], list[int]]) -> None:
    """Repeated, unsorted and consecutive IDs alike: the same stable order and the same runs."""
    loc, rem = pair
    small = find_runs(loc, rem)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(coalesce, "SMALL_PAIRS", 0)
        vectorised = find_runs(loc, rem)
    for name in ("local_ids", "remote_ids", "local_start", "remote_start", "length"):
        a, b = getattr(small, name), getattr(vectorised, name)
        assert a.dtype == b.dtype == np.int64 and a.tolist() == b.tolist(), name


@PROPS
@given(ids=st.lists(st.integers(-2, 40), max_size=70), num_blocks=st.integers(1, 40))
def test_check_kernel_small_path_agrees(ids: list[int], num_blocks: int) -> None:
    arr = np.array(ids, dtype=np.int64)

    def outcome() -> object:
        try:
            plan_mod._check_kernel(arr, num_blocks, "groups[0].local_kernel_ids")
        except KvxferdError as err:
            return (err.field, err.message)
        return None

    small = outcome()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_mod, "SMALL_IDS", 0)
        assert outcome() == small
