"""The entry point: a pull request's logical block IDs -> byte ranges per remote TP rank.

:func:`plan_pull` first tries the plain route of the spec pair (:mod:`.route`: the usual
layout, whose spec-only facts are worked out once), then the general path,
:func:`plan_general`, which runs, in order: group-count and region-pairing checks; bounds
checks of every ID list (all groups, both sides) **before** anything is expanded; per-group
pairing (:mod:`.trim`); a re-check of the kernel IDs against the registered kernel counts; TP
segments per region pair (:mod:`.tp`); coalescing per region (:mod:`.coalesce`), with the run
structure computed once per group and the ranges shared between regions of identical geometry.
Both give the same plan, or the same error, for every request.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

import numpy as np

from kvxferd.blocks.bounds import DEFAULT_MAX_IDS, SMALL_IDS, BlockIds, check_block_ids
from kvxferd.blocks.coalesce import Runs, find_runs, mergeable, region_ranges
from kvxferd.blocks.ranges import (
    Int64Array,
    PullPlan,
    RegionRanges,
    SharedRanges,
    TransferPlan,
    frozen,
)
from kvxferd.blocks.reblock import ChunkPairs, chunk_ranges, chunk_segments, pair_chunks
from kvxferd.blocks.route import geometry_classes, plain_route, segments
from kvxferd.blocks.tp import TPPosition, check_tp, tp_ratio
from kvxferd.blocks.trim import pair_group
from kvxferd.errors import BlockRangeError, InvalidRequest
from kvxferd.layout.spec import KVCacheSpec, Region


def _check_pairing(local: KVCacheSpec, remote: KVCacheSpec) -> None:
    if local.pairing == remote.pairing:  # cached per spec; the loop below only words the error
        return
    if len(local.groups) != len(remote.groups):
        raise InvalidRequest(
            f"local spec has {len(local.groups)} KV cache groups, remote {len(remote.groups)}",
            field="groups",
            fix="both peers must serve the same model with the same KV cache groups",
        )
    if len(local.regions) != len(remote.regions):
        raise InvalidRequest(
            f"local spec has {len(local.regions)} regions, remote {len(remote.regions)}",
            field="regions",
            fix="both peers must register the same regions in the same order",
        )
    for i, (lr, rr) in enumerate(zip(local.regions, remote.regions, strict=True)):
        if lr.name != rr.name or lr.group != rr.group:
            raise InvalidRequest(
                f"region {i} does not pair: local {lr.name!r} (group {lr.group}), remote"
                f" {rr.name!r} (group {rr.group})",
                field=f"regions[{i}]",
                fix="both peers must register the same regions in the same order",
            )


def _check_kernel(ids: Int64Array, num_blocks: int, field: str) -> None:
    n = ids.shape[0]
    if not n:
        return
    if n <= SMALL_IDS:  # Python ints: cheaper than two NumPy reductions for a short list
        vals = ids.tolist()
        lo, hi = min(vals), max(vals)
    else:
        lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_blocks:
        bad = np.flatnonzero((ids < 0) | (ids >= num_blocks))
        raise BlockRangeError(
            f"kernel block ID {int(ids[bad[0]])} at index {int(bad[0])} is outside the"
            f" registered {num_blocks} kernel blocks; {bad.shape[0]} IDs are out of range",
            field=f"{field}[{int(bad[0])}]",
            fix="check the peers' registered block counts and ppl",
        )


def _region_entries(
    i: int,
    lr: Region,
    rr: Region,
    run: Runs | ChunkPairs,
    *,
    local_tp: TPPosition,
    remote_tp: TPPosition,
    num_kv_heads: int | None,
) -> list[tuple[int, RegionRanges, int]]:
    """Per remote rank read: (rank, region ``i``'s ranges over read-only arrays, naive
    descriptor count)."""
    out: list[tuple[int, RegionRanges, int]] = []
    if isinstance(run, ChunkPairs):
        for cs in chunk_segments(
            lr,
            rr,
            run.tokens,
            local_tp=local_tp,
            remote_tp=remote_tp,
            num_kv_heads=num_kv_heads,
            field=f"regions[{i}]",
        ):
            rg = chunk_ranges(
                run,
                cs,
                region=i,
                name=lr.name,
                local_stride=lr.stride,
                remote_stride=rr.stride,
            )
            rg = RegionRanges(
                i, lr.name, frozen(rg.local_offset), frozen(rg.remote_offset), frozen(rg.length)
            )
            out.append((cs.remote_rank, rg, run.num_pairs * int(cs.local_base.shape[0])))
        return out
    segs = segments(
        lr,
        rr,
        local_tp=(local_tp[0], local_tp[1]),  # hashable whatever sequence the caller passed
        remote_tp=(remote_tp[0], remote_tp[1]),
        num_kv_heads=num_kv_heads,
        field=f"regions[{i}]",
    )
    for seg in segs:
        rg = region_ranges(
            run,
            region=i,
            name=lr.name,
            local_stride=lr.stride,
            remote_stride=rr.stride,
            seg=seg,
            merge=mergeable(lr, rr, seg),
        )
        rg = RegionRanges(
            i,
            lr.name,
            frozen(rg.local_offset),
            frozen(rg.remote_offset),
            frozen(rg.length),
            rg.coalesced,
        )
        out.append((seg.remote_rank, rg, run.num_blocks * seg.num_segments))
    return out


def plan_pull(
    local: KVCacheSpec,
    remote: KVCacheSpec,
    local_ids: Sequence[BlockIds],
    remote_ids: Sequence[BlockIds],
    *,
    prefix_caching: bool,
    local_tp: TPPosition = (0, 1),
    remote_tp: TPPosition = (0, 1),
    max_ids: int = DEFAULT_MAX_IDS,
    num_kv_heads: int | None = None,
) -> PullPlan:
    """Plan a pull of ``remote_ids`` (the peer's blocks) into ``local_ids`` (ours).

    ``local_ids[g]`` / ``remote_ids[g]``: **logical** block IDs of group ``g`` (group order =
    ``spec.groups``), each a sequence of ints or a 1-D integer array; state groups list states.
    ``local_tp`` / ``remote_tp``: ``(rank, size)``; the remote rank is ignored (the plan picks
    the remote ranks). ``num_kv_heads``: the model's total, inferred from the regions when
    ``None``. Raises :class:`InvalidRequest` (:class:`BlockRangeError` for IDs) or
    :class:`SpecError` before producing any range.
    """
    route = plain_route(local, remote, local_tp, remote_tp, num_kv_heads)
    if route is not None:  # the usual layout: planned from what the specs settle, kept
        plain = route.plan(local_ids, remote_ids, max_ids)
        if plain is not None:
            return plain
    return plan_general(
        local,
        remote,
        local_ids,
        remote_ids,
        prefix_caching=prefix_caching,
        local_tp=local_tp,
        remote_tp=remote_tp,
        max_ids=max_ids,
        num_kv_heads=num_kv_heads,
    )


def plan_general(
    local: KVCacheSpec,
    remote: KVCacheSpec,
    local_ids: Sequence[BlockIds],
    remote_ids: Sequence[BlockIds],
    *,
    prefix_caching: bool,
    local_tp: TPPosition = (0, 1),
    remote_tp: TPPosition = (0, 1),
    max_ids: int = DEFAULT_MAX_IDS,
    num_kv_heads: int | None = None,
) -> PullPlan:
    """:func:`plan_pull` for every layout, deriving everything from the specs each time:
    what ``plan_pull`` runs when the plain route (kvxferd/blocks/route.py) does not apply,
    and the reference the route is tested against."""
    check_tp(local_tp, "local_tp")
    check_tp(remote_tp, "remote_tp")
    ratio = tp_ratio(local_tp[1], remote_tp[1])
    _check_pairing(local, remote)
    n_groups = len(local.groups)
    if len(local_ids) != n_groups or len(remote_ids) != n_groups:
        raise InvalidRequest(
            f"the model has {n_groups} KV cache groups, got {len(local_ids)} local and"
            f" {len(remote_ids)} remote block-ID lists",
            field="groups",
            fix="pass one block-ID list per group, in the spec's group order",
        )

    checked: list[tuple[Int64Array, Int64Array]] = []
    for g in range(n_groups):
        checked.append(
            (
                check_block_ids(
                    local_ids[g],
                    local.num_logical_blocks(g),
                    f"groups[{g}].local_block_ids",
                    max_ids=max_ids,
                ),
                check_block_ids(
                    remote_ids[g],
                    remote.num_logical_blocks(g),
                    f"groups[{g}].remote_block_ids",
                    max_ids=max_ids,
                ),
            )
        )

    # Per group; its arrays are frozen and shared by the plans. Groups whose kernel block
    # sizes differ pair at the chunk (docs/domain.md §5, rule 3; kvxferd/blocks/reblock.py).
    runs: list[Runs | ChunkPairs] = []
    for g, (lids, rids) in enumerate(checked):
        lg, rg = local.groups[g], remote.groups[g]
        if (
            lg.kind is rg.kind
            and not lg.kind.is_state
            and lg.kernel_block_size != rg.kernel_block_size
        ):
            cp = pair_chunks(
                lg, rg, lids, rids, prefix_caching=prefix_caching, field=f"groups[{g}]"
            )
            _check_kernel(
                cp.local_kernel, local.num_kernel_blocks(g), f"groups[{g}].local_kernel_ids"
            )
            _check_kernel(
                cp.remote_kernel,
                remote.num_kernel_blocks(g),
                f"groups[{g}].remote_kernel_ids",
            )
            for a in (cp.local_kernel, cp.local_sub, cp.remote_kernel, cp.remote_sub):
                frozen(a)
            runs.append(cp)
            continue
        lk, rk = pair_group(
            lg,
            rg,
            lids,
            rids,
            prefix_caching=prefix_caching,
            field=f"groups[{g}]",
        )
        _check_kernel(lk, local.num_kernel_blocks(g), f"groups[{g}].local_kernel_ids")
        _check_kernel(rk, remote.num_kernel_blocks(g), f"groups[{g}].remote_kernel_ids")
        run = find_runs(lk, rk)
        for a in (run.local_ids, run.remote_ids, run.local_start, run.remote_start, run.length):
            frozen(a)
        runs.append(run)

    # Regions of one group with the same geometry on both sides (typically every layer) get
    # the same segments and byte ranges: compute them once per class (in the order of each
    # class's first region), share the read-only arrays.
    regions = local.regions
    classes: dict[int, list[SharedRanges]] = {}  # TransferPlan.classes, per rank
    naive: dict[int, int] = {}
    groups_read: dict[int, set[int]] = {}
    for members, indices in geometry_classes(local.geometry_ids, remote.geometry_ids):
        i = members[0]
        lr = regions[i]
        for rank, first, n_naive in _region_entries(
            i,
            lr,
            remote.regions[i],
            runs[lr.group],
            local_tp=local_tp,
            remote_tp=remote_tp,
            num_kv_heads=num_kv_heads,
        ):
            got = classes.get(rank)
            if got is None:
                got = classes[rank] = []
            if first.length.shape[0]:  # a class this rank reads nothing of stays out
                got.append(SharedRanges(indices, first))
            naive[rank] = naive.get(rank, 0) + n_naive * len(members)
            groups_read.setdefault(rank, set()).add(lr.group)

    empty = frozen(np.zeros(0, dtype=np.int64))
    kernel = [_kernel_blocks(run) for run in runs]
    per_rank: dict[int, TransferPlan] = {}
    for r in sorted(classes):
        blocks = tuple(kernel[g][0] if g in groups_read[r] else empty for g in range(n_groups))
        per_rank[r] = TransferPlan.of_classes(regions, tuple(classes[r]), blocks, naive[r])

    l_rank, l_size = local_tp
    notify = set(per_rank) | {r for r in range(remote_tp[1]) if r % l_size == l_rank}
    return PullPlan(
        local_tp=local_tp,
        remote_tp=remote_tp,
        tp_ratio=ratio,
        per_rank=MappingProxyType(per_rank),
        notify_ranks=tuple(sorted(notify)),
        local_kernel_blocks=tuple(k[0] for k in kernel),
        remote_kernel_blocks=tuple(k[1] for k in kernel),
    )


def _kernel_blocks(run: Runs | ChunkPairs) -> tuple[Int64Array, Int64Array]:
    """The kernel blocks a group's pairs touch on each side: the pairs themselves, or for
    chunk pairs each side's distinct kernel blocks (sorted)."""
    if isinstance(run, ChunkPairs):
        return frozen(np.unique(run.local_kernel)), frozen(np.unique(run.remote_kernel))
    return run.local_ids, run.remote_ids
