"""Logical <-> kernel block IDs (docs/domain.md §4).

Logical block ``L`` of an attention group with ``ppl`` kernel blocks per logical block covers
kernel blocks ``L*ppl .. L*ppl+ppl-1``. State (Mamba) groups are never expanded.

The rule a silent-corruption bug in vLLM's connector taught: expand **remote** IDs with the
**remote** group's ``ppl`` and local IDs with the local one. Callers pass the group of the side
the IDs belong to; nothing here knows a "default" ``ppl``.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.ranges import Int64Array
from kvxferd.errors import InvalidRequest, SpecError
from kvxferd.layout.spec import KVGroup


def _check_ppl(ppl: int) -> None:
    if ppl < 1:
        raise SpecError(
            f"kernel blocks per logical block must be >= 1, got {ppl}",
            fix="check the group's logical and kernel block sizes",
        )


def logical_to_kernel(ids: npt.ArrayLike, ppl: int) -> Int64Array:
    """Expand logical block IDs to kernel block IDs.

    ``ids``: shape ``(n,)`` of (already validated) logical IDs. Returns shape ``(n * ppl,)``
    int64: ``[L0*ppl, ..., L0*ppl+ppl-1, L1*ppl, ...]`` in the input order. One broadcast, no
    Python loop.
    """
    _check_ppl(ppl)
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ppl == 1:
        return arr.copy()
    return (arr[:, None] * ppl + np.arange(ppl, dtype=np.int64)[None, :]).reshape(-1)


def kernel_to_logical(kernel_ids: npt.ArrayLike, ppl: int, *, field: str = "") -> Int64Array:
    """Collapse kernel block IDs back to logical IDs; the inverse of :func:`logical_to_kernel`.

    ``kernel_ids``: shape ``(n * ppl,)``, each logical block's ``ppl`` kernel blocks complete,
    in order. Returns shape ``(n,)`` int64. Raises :class:`InvalidRequest` naming the first
    kernel ID that breaks a logical block (partial, misaligned or out of order).
    """
    _check_ppl(ppl)
    arr = np.asarray(kernel_ids, dtype=np.int64).reshape(-1)
    if arr.shape[0] % ppl:
        raise InvalidRequest(
            f"{arr.shape[0]} kernel block IDs are not a whole number of logical blocks of"
            f" {ppl} kernel blocks",
            field=field,
            fix="pass every kernel block of each logical block",
        )
    rows = arr.reshape(-1, ppl)
    first = rows[:, 0]
    expected = first[:, None] + np.arange(ppl, dtype=np.int64)[None, :]
    bad = (rows != expected) | (first % ppl != 0)[:, None]
    if bad.any():
        i = int(np.flatnonzero(bad.reshape(-1))[0])
        row = i // ppl
        raise InvalidRequest(
            f"kernel block ID {int(arr[i])} at index {i} does not complete a logical block"
            f" (logical block {row} must be kernel blocks"
            f" {int(first[row]) // ppl * ppl}..{int(first[row]) // ppl * ppl + ppl - 1})",
            field=f"{field}[{i}]" if field else f"[{i}]",
            fix="kernel IDs must come in aligned runs of ppl consecutive IDs",
        )
    return first // ppl


def expand_group(group: KVGroup, logical_ids: npt.ArrayLike) -> Int64Array:
    """Kernel block IDs of ``logical_ids`` in ``group`` (the group of the side they belong to).

    Attention/MLA groups: :func:`logical_to_kernel` with ``group.ppl``; state groups: the IDs
    unchanged (a state block is never split). Returns a new int64 array.
    """
    if group.kind.is_state:
        return np.asarray(logical_ids, dtype=np.int64).reshape(-1).copy()
    return logical_to_kernel(logical_ids, group.ppl)


def logical_blocks_of(kernel_ids: npt.ArrayLike, ppl: int) -> Int64Array:
    """The logical blocks that hold any of ``kernel_ids`` (any kernel IDs, in any order), each
    once, in the order of its first kernel block: a logical block with one undefined kernel
    block is undefined as a whole (a failed pull's invalid blocks, in the IDs its caller
    sent). ``ppl`` 1 (a state group, or unsplit blocks) returns the IDs deduplicated."""
    _check_ppl(ppl)
    logical = np.asarray(kernel_ids, dtype=np.int64).reshape(-1) // ppl
    _, first = np.unique(logical, return_index=True)
    return logical[np.sort(first)]
