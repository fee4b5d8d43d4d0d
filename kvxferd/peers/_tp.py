"""TP arithmetic the compatibility check needs (private).

``kvxferd.blocks.tp`` (being written alongside) will own the TP slice math used for planning;
until it lands, the handshake computes divisibility and KV heads per rank here. The rules are
domain.md §6: one TP size must divide the other; heads are sliced evenly, and when TP exceeds
the model's KV heads every rank holds one (replicated) head.
"""

from __future__ import annotations


def tp_ratio(local_tp: int, remote_tp: int) -> int | None:
    """``local // remote`` if local >= remote, else ``-(remote // local)``; None: no division."""
    if local_tp >= remote_tp:
        return local_tp // remote_tp if local_tp % remote_tp == 0 else None
    return -(remote_tp // local_tp) if remote_tp % local_tp == 0 else None


def heads_per_rank(total_kv_heads: int, tp_size: int) -> int | None:
    """KV heads one rank holds for a model with ``total_kv_heads``; None if TP cannot split them."""
    if total_kv_heads >= tp_size:
        return total_kv_heads // tp_size if total_kv_heads % tp_size == 0 else None
    return 1 if tp_size % total_kv_heads == 0 else None


def total_heads_candidates(heads: int, tp_size: int, declared: int | None) -> frozenset[int]:
    """Model KV-head counts consistent with holding ``heads`` per rank at ``tp_size``.

    With more than one head per rank nothing is replicated, so the total is exact; with one head
    per rank any total dividing ``tp_size`` fits (replicated heads). ``declared`` (the model's
    KV heads, when the peer advertises it) narrows the answer to itself, or to nothing.
    """
    if declared is not None:
        return frozenset({declared}) if heads_per_rank(declared, tp_size) == heads else frozenset()
    if heads > 1:
        return frozenset({heads * tp_size})
    return frozenset(d for d in range(1, tp_size + 1) if tp_size % d == 0)
