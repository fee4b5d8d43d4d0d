"""Block-ID validation: every ID is checked against the registered count before any range exists.

docs/domain.md §8: an out-of-range ID must never become a read outside the registered region. The
checks are vectorised, except that a short list (:data:`SMALL_IDS`) is first checked on Python
ints (a dozen NumPy calls cost more than such a list); the error names the first offending index
and value and how many IDs were bad, with the input's field path
(``groups[1].remote_block_ids[3]``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.ranges import Int64Array
from kvxferd.errors import BlockRangeError, InvalidRequest

DEFAULT_MAX_IDS = 1 << 20
"""Default cap on the length of one block-ID list (per group, per side)."""

BlockIds = Sequence[int] | npt.NDArray[np.integer]
"""One group's block IDs as the caller gives them: a sequence of ints or an integer array."""

_INT_TYPES: frozenset[type] = frozenset(
    {int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64}
)


SMALL_IDS = 64
"""Lists up to this long are checked on Python ints first (a pull's usual case: a few dozen
blocks); one that fails is checked again vectorised, which words the error."""

_MASK_LIMIT = 1 << 22
"""Duplicates are found with a mask of ``num_blocks`` booleans up to this size (else a sort)."""


def _where(field: str, i: int) -> str:
    return f"{field}[{i}]"


def _first_non_int(ids: Sequence[object]) -> int:
    for i, x in enumerate(ids):
        if type(x) not in _INT_TYPES:
            return i
    return -1


def _as_int64(ids: object, field: str) -> Int64Array:
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1:
            raise InvalidRequest(
                f"block IDs must be a 1-D list, got an array of shape {ids.shape}",
                field=field,
                fix="pass one flat list of block IDs per group",
            )
        if ids.dtype.kind not in "iu":
            raise BlockRangeError(
                f"block IDs must be integers, got an array of dtype {ids.dtype}",
                field=field,
                fix="pass integer block IDs",
            )
        if ids.dtype.kind == "u" and ids.size and int(ids.max()) > np.iinfo(np.int64).max:
            i = int(np.flatnonzero(ids > np.iinfo(np.int64).max)[0])
            raise BlockRangeError(
                f"block ID {int(ids[i])} at index {i} is out of range",
                field=_where(field, i),
                fix="pass block IDs below the registered number of blocks",
            )
        return ids.astype(np.int64, copy=True)
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InvalidRequest(
            f"block IDs must be a list of integers, got {type(ids).__name__}",
            field=field,
            fix="pass one flat list of block IDs per group",
        )
    kinds = set(map(type, ids))
    if not kinds <= _INT_TYPES:
        i = _first_non_int(ids)
        bad = sum(1 for x in ids if type(x) not in _INT_TYPES)
        raise BlockRangeError(
            f"block ID {ids[i]!r} at index {i} is not an integer ({type(ids[i]).__name__});"
            f" {bad} of {len(ids)} IDs are not integers",
            field=_where(field, i),
            fix="pass integer block IDs (no floats, bools or strings)",
        )
    try:
        return np.array(ids, dtype=np.int64).reshape(-1)
    except OverflowError:
        big = [i for i, x in enumerate(ids) if not -(1 << 63) <= int(x) < (1 << 63)]
        raise BlockRangeError(
            f"block ID {ids[big[0]]} at index {big[0]} is out of range; {len(big)} of"
            f" {len(ids)} IDs do not fit in 64 bits",
            field=_where(field, big[0]),
            fix="pass block IDs below the registered number of blocks",
        ) from None


def check_block_ids(
    ids: BlockIds | object,
    num_blocks: int,
    field: str,
    *,
    max_ids: int = DEFAULT_MAX_IDS,
) -> Int64Array:
    """Validate one block-ID list and return it as a fresh int64 array of shape ``(n,)``.

    Rejects, in this order: more than ``max_ids`` IDs (:class:`InvalidRequest`); a non-list or
    non-1-D input (:class:`InvalidRequest`); non-integers (floats, bools, strings), negative
    IDs, IDs ``>= num_blocks`` and duplicates (:class:`BlockRangeError`). ``num_blocks`` is in
    the unit of the IDs (logical blocks for attention groups, states for state groups).
    ``field`` names the input (``groups[1].remote_block_ids``); errors append ``[index]``.
    """
    try:
        n = len(ids)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidRequest(
            f"block IDs must be a list of integers, got {type(ids).__name__}",
            field=field,
            fix="pass one flat list of block IDs per group",
        ) from None
    if n > max_ids:
        raise InvalidRequest(
            f"{n} block IDs exceed the limit of {max_ids} per group",
            field=field,
            fix=f"split the request or raise max_ids (now {max_ids})",
        )
    arr = _as_int64(ids, field)
    if arr.shape[0] == 0:
        return arr
    if n <= SMALL_IDS:
        vals = arr.tolist()
        if min(vals) >= 0 and max(vals) < num_blocks and len(set(vals)) == n:
            return arr
    bad = (arr < 0) | (arr >= num_blocks)
    if bad.any():
        where = np.flatnonzero(bad)
        i = int(where[0])
        v = int(arr[i])
        why = "is negative" if v < 0 else f"is not below the registered {num_blocks} blocks"
        raise BlockRangeError(
            f"block ID {v} at index {i} {why}; {where.shape[0]} of {n} IDs are out of range"
            f" [0, {num_blocks})",
            field=_where(field, i),
            fix=f"pass block IDs in [0, {num_blocks}) as registered with the peer",
        )
    if num_blocks <= max(_MASK_LIMIT, 16 * n):
        seen = np.zeros(num_blocks, dtype=bool)
        seen[arr] = True
        if int(np.count_nonzero(seen)) == n:
            return arr
    order = np.argsort(arr, kind="stable")
    s = arr[order]
    dup_sorted = np.flatnonzero(s[1:] == s[:-1]) + 1
    if dup_sorted.shape[0]:
        # With a stable sort, the later occurrence follows the earlier one: report the
        # smallest input index that repeats an earlier ID.
        dup_idx = order[dup_sorted]
        i = int(dup_idx.min())
        v = int(arr[i])
        first = int(np.flatnonzero(arr == v)[0])
        raise BlockRangeError(
            f"block ID {v} at index {i} repeats index {first}; {dup_idx.shape[0]} of {n} IDs"
            f" are duplicates",
            field=_where(field, i),
            fix="list every block once",
        )
    return arr
