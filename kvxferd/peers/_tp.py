"""TP arithmetic the compatibility check needs (private), on top of :mod:`kvxferd.blocks.tp`.

The planner's rules (docs/domain.md §6) are the single source: ``tp_ratio`` and ``kv_head_range``
come from :mod:`kvxferd.blocks.tp`; here they answer ``None`` instead of raising, because the
handshake reports every mismatch instead of stopping at the first.
"""

from __future__ import annotations

from kvxferd.blocks import tp as _tp
from kvxferd.errors import InvalidRequest


def tp_ratio(local_tp: int, remote_tp: int) -> int | None:
    """``local // remote`` if local >= remote, else ``-(remote // local)``; None: no division."""
    try:
        return _tp.tp_ratio(local_tp, remote_tp)
    except InvalidRequest:
        return None


def heads_per_rank(total_kv_heads: int, tp_size: int) -> int | None:
    """KV heads one rank holds for a model with ``total_kv_heads``; None if TP cannot split them."""
    try:
        return _tp.kv_head_range(0, tp_size, total_kv_heads)[1]
    except InvalidRequest:
        return None


def total_heads_candidates(heads: int, tp_size: int, declared: int | None) -> frozenset[int]:
    """Model KV-head counts consistent with holding ``heads`` per rank at ``tp_size``.

    With more than one head per rank nothing is replicated, so the total is exact; with one head
    per rank any total dividing ``tp_size`` fits (replicated heads). ``declared`` (the model's
    KV heads, when the peer advertises it) narrows the answer to itself, or to nothing. Two
    sides agree when their candidate sets intersect (the planner's ``infer_num_kv_heads``
    accepts exactly those pairs, a property test checks).
    """
    if declared is not None:
        return frozenset({declared}) if heads_per_rank(declared, tp_size) == heads else frozenset()
    if heads > 1:
        return frozenset({heads * tp_size})
    return frozenset(d for d in range(1, tp_size + 1) if tp_size % d == 0)
