"""Heterogeneous tensor parallelism: which remote ranks a local rank reads, and which bytes.

Terms (docs/domain.md §6): *local* is the reader (decode side), *remote* the prefill side. A TP
position is ``(rank, size)``. ``num_kv_heads`` here is the model's **total** KV head count;
a region's shape holds the **per-rank** count.

* ``tp_ratio = local_tp // remote_tp`` when ``local_tp >= remote_tp``, else
  ``-(remote_tp // local_tp)``; one must divide the other.
* Head ownership: with ``tp <= H`` rank ``r`` owns heads ``[r*H/tp, (r+1)*H/tp)``; with
  ``tp > H`` each head is replicated on ``tp/H`` consecutive ranks and rank ``r`` owns head
  ``r // (tp/H)``.
* Dedup: a local rank reads each of its heads **once**. When the remote replicates heads, the
  copy read is ``head*m + local_rank % m`` (``m = remote_tp/H`` copies): deterministic, and it
  spreads readers over the copies.
* Segments inside one block, per remote rank read (``(offset_in_block, length)`` on each side):

  - head ranges equal on both sides (``tp_ratio == 1``, or both replicated): the whole block;
  - otherwise both sides must be head-major (``HND`` / ``CROSS_LAYER_HND``): for each K and V
    half (``2 * num_layers`` halves) the slice of heads shared by the two ranks, at the head
    offsets inside each side's half. ``tp_ratio > 0``: one remote rank, the local rank's
    slice of its heads. ``tp_ratio < 0``: ``|tp_ratio|`` remote ranks (fewer after dedup),
    each filling a disjoint head slice of the local halves. ``NHD`` cannot be sliced and is
    refused with a message to register ``HND``.
  - ``MLA`` (replicated latent): the whole block from remote rank ``local_rank % remote_tp``;
    the other remote ranks are only notified.
  - ``STATE`` (Mamba): the state layout is opaque to kvxferd, so a state is only ever copied
    whole: both sides' state blocks must have the same length (the state is replicated, or the
    TP sizes are equal), and the source is remote rank ``local_rank * remote_tp // local_tp``
    (the rank holding this rank's attention heads when ``tp_ratio > 0``). Unequal state sizes
    (a sharded state under heterogeneous TP) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxferd.blocks.ranges import Int64Array
from kvxferd.errors import InvalidRequest
from kvxferd.layout.spec import Layout, Region

TPPosition = tuple[int, int]
"""``(rank, size)`` of one side's tensor-parallel group."""


def check_tp(pos: TPPosition, field: str) -> None:
    """Refuse a TP position whose size is < 1 or whose rank is outside ``[0, size)``."""
    rank, size = pos
    if size < 1 or not 0 <= rank < size:
        raise InvalidRequest(
            f"TP position (rank {rank}, size {size}) is invalid",
            field=field,
            fix="the TP size must be >= 1 and the rank in [0, size)",
        )


def tp_ratio(local_tp: int, remote_tp: int) -> int:
    """``local_tp // remote_tp`` if ``local_tp >= remote_tp`` else ``-(remote_tp // local_tp)``.

    ``local`` is the reader (decode). Raises :class:`InvalidRequest` unless one divides the
    other.
    """
    if local_tp < 1 or remote_tp < 1:
        raise InvalidRequest(
            f"TP sizes must be >= 1, got local {local_tp} and remote {remote_tp}",
            field="tp",
            fix="pass the TP sizes of both peers",
        )
    if local_tp >= remote_tp:
        if local_tp % remote_tp == 0:
            return local_tp // remote_tp
    elif remote_tp % local_tp == 0:
        return -(remote_tp // local_tp)
    raise InvalidRequest(
        f"TP sizes do not divide: local (decode) {local_tp}, remote (prefill) {remote_tp}",
        field="tp",
        fix="pick TP sizes where one is a multiple of the other",
    )


def kv_head_range(rank: int, tp: int, num_kv_heads: int) -> tuple[int, int]:
    """``(first_head, count)`` of the KV heads that TP rank ``rank`` of ``tp`` holds.

    ``num_kv_heads`` is the model's total. ``tp > num_kv_heads`` replicates: each rank holds
    one head, head ``rank // (tp // num_kv_heads)``.
    """
    check_tp((rank, tp), "tp")
    if num_kv_heads < 1:
        raise InvalidRequest(
            f"num_kv_heads must be >= 1, got {num_kv_heads}",
            field="num_kv_heads",
            fix="leave it out (inferred from the regions) or give the model's KV heads",
        )
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise InvalidRequest(
                f"{num_kv_heads} KV heads do not split over TP {tp}",
                field="tp",
                fix="use a TP size that divides the KV head count",
            )
        per = num_kv_heads // tp
        return rank * per, per
    if tp % num_kv_heads:
        raise InvalidRequest(
            f"TP {tp} is not a multiple of the {num_kv_heads} KV heads it replicates",
            field="tp",
            fix="use a TP size that is a multiple of the KV head count",
        )
    return rank // (tp // num_kv_heads), 1


def infer_num_kv_heads(
    local_heads: int, local_tp: int, remote_heads: int, remote_tp: int, *, field: str = ""
) -> int:
    """The model's total KV heads from both sides' per-rank head counts.

    ``min(local_heads*local_tp, remote_heads*remote_tp)``; a side whose product is larger
    must be replicating (one head per rank, TP a multiple of the total). When both sides
    replicate the true total may be smaller than inferred; the ranks chosen still hold the
    right head (nested floor division), so the plan is the same bytes.
    """
    total = min(local_heads * local_tp, remote_heads * remote_tp)
    for side, heads, tp in (("local", local_heads, local_tp), ("remote", remote_heads, remote_tp)):
        if heads * tp != total and not (heads == 1 and tp % total == 0):
            raise InvalidRequest(
                f"KV heads per rank do not match the TP slice arithmetic: local {local_heads}"
                f" heads x TP {local_tp}, remote {remote_heads} heads x TP {remote_tp}"
                f" ({side} side)",
                field=field,
                fix="both peers must hold the same model's KV heads split by their TP sizes",
            )
    return total


@dataclass(frozen=True)
class HeadSource:
    """Heads ``[first_head, first_head + count)`` (model-global) read from ``remote_rank``."""

    remote_rank: int
    first_head: int
    count: int


def head_sources(
    local_rank: int, local_tp: int, remote_tp: int, num_kv_heads: int
) -> tuple[HeadSource, ...]:
    """Which remote ranks provide which of ``local_rank``'s heads, each head once (dedup).

    Sorted by head. For ``tp_ratio >= 1`` one source; for ``tp_ratio < 0`` up to
    ``|tp_ratio|`` (fewer when the remote replicates heads).
    """
    first, count = kv_head_range(local_rank, local_tp, num_kv_heads)
    if remote_tp <= num_kv_heads:
        per = num_kv_heads // remote_tp
        out = []
        for r in range(first // per, (first + count - 1) // per + 1):
            lo, hi = max(first, r * per), min(first + count, (r + 1) * per)
            out.append(HeadSource(r, lo, hi - lo))
        return tuple(out)
    kv_head_range(0, remote_tp, num_kv_heads)  # validates divisibility
    copies = remote_tp // num_kv_heads
    return tuple(
        HeadSource(h * copies + local_rank % copies, h, 1) for h in range(first, first + count)
    )


@dataclass(frozen=True)
class RankSegments:
    """The bytes of every paired block read from one remote rank, for one region pair.

    ``local_offset``, ``remote_offset``, ``length``: int64, shape ``(S,)``: segment ``s`` moves
    ``length[s]`` bytes from ``remote_offset[s]`` inside each remote block to ``local_offset[s]``
    inside the paired local block. ``whole_block``: one segment, the entire (equal-length)
    block on both sides, so consecutive blocks may merge.
    """

    remote_rank: int
    local_offset: Int64Array
    remote_offset: Int64Array
    length: Int64Array
    whole_block: bool

    @property
    def num_segments(self) -> int:
        return int(self.length.shape[0])

    @staticmethod
    def whole(remote_rank: int, block_len: int) -> RankSegments:
        z = np.zeros(1, dtype=np.int64)
        return RankSegments(remote_rank, z, z.copy(), np.array([block_len], np.int64), True)


def require_same(
    local: Region, remote: Region, what: str, a: object, b: object, *, field: str
) -> None:
    if a != b:
        raise InvalidRequest(
            f"region {local.name!r}: {what} differs (local {a}, remote {b});"
            f" local {local.describe()}, remote {remote.describe()}",
            field=field,
            fix="the peers' regions must agree (the handshake should have refused this peer)",
        )


def region_segments(
    local: Region,
    remote: Region,
    *,
    local_tp: TPPosition = (0, 1),
    remote_tp: TPPosition = (0, 1),
    num_kv_heads: int | None = None,
    field: str = "",
) -> tuple[RankSegments, ...]:
    """Per remote rank to read, the segments of each paired block of this region pair.

    ``local_tp``/``remote_tp`` are ``(rank, size)``; only the local rank matters (the remote
    rank is what this function picks). ``num_kv_heads``: the model total, inferred from the
    regions' per-rank head counts when ``None``. Sorted by remote rank. See the module
    docstring for the rules; raises :class:`InvalidRequest` when the pair cannot be read.
    """
    check_tp(local_tp, "local_tp")
    check_tp(remote_tp, "remote_tp")
    l_rank, l_size = local_tp
    _, r_size = remote_tp
    tp_ratio(l_size, r_size)
    require_same(local, remote, "layout", local.layout.value, remote.layout.value, field=field)
    require_same(local, remote, "dtype", local.dtype.value, remote.dtype.value, field=field)

    if not local.layout.has_kv_halves:
        require_same(local, remote, "block length", local.block_len, remote.block_len, field=field)
        mla = local.layout is Layout.MLA
        src = l_rank % r_size if mla else l_rank * r_size // l_size
        return (RankSegments.whole(src, local.block_len),)

    require_same(local, remote, "layers", local.num_layers, remote.num_layers, field=field)
    require_same(local, remote, "head size", local.head_size, remote.head_size, field=field)
    require_same(
        local,
        remote,
        "tokens per block",
        local.tokens_per_block,
        remote.tokens_per_block,
        field=field,
    )
    total = num_kv_heads or infer_num_kv_heads(
        local.num_kv_heads, l_size, remote.num_kv_heads, r_size, field=field
    )
    l_first, l_count = kv_head_range(l_rank, l_size, total)
    require_same(local, remote, "local heads per rank", local.num_kv_heads, l_count, field=field)
    r_count = kv_head_range(0, r_size, total)[1]
    require_same(local, remote, "remote heads per rank", remote.num_kv_heads, r_count, field=field)

    head_bytes = local.tokens_per_block * local.head_size * local.dtype.itemsize
    halves = np.arange(2 * local.num_layers, dtype=np.int64)
    out = []
    for hs in head_sources(l_rank, l_size, r_size, total):
        r_first = kv_head_range(hs.remote_rank, r_size, total)[0]
        if hs.first_head == l_first == r_first and hs.count == l_count == r_count:
            out.append(RankSegments.whole(hs.remote_rank, local.block_len))
            continue
        if not local.layout.head_major:
            raise InvalidRequest(
                f"region {local.name!r} is {local.layout.value}: a {l_count}-head slice of"
                f" TP {l_size} cannot be read from a TP {r_size} peer's blocks because one"
                " head's tokens are not contiguous",
                field=field,
                fix="register the KV cache head-major (HND / CROSS_LAYER_HND) on both peers,"
                " or run equal TP sizes",
            )
        out.append(
            RankSegments(
                hs.remote_rank,
                halves * (l_count * head_bytes) + (hs.first_head - l_first) * head_bytes,
                halves * (r_count * head_bytes) + (hs.first_head - r_first) * head_bytes,
                np.full(halves.shape[0], hs.count * head_bytes, dtype=np.int64),
                False,
            )
        )
    return tuple(sorted(out, key=lambda s: s.remote_rank))
