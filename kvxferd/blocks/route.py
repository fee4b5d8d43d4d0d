"""Plain pulls planned in a few steps: what only the two specs decide, worked out once.

For every request, the general planner (:func:`kvxferd.blocks.plan.plan_pull`) derives again
what depends only on the two specs and the TP placement: how each group pairs, which regions
share a geometry, each class's segments and strides, the ranks read and notified. Most
deployments are *plain*: every group attention (or MLA) with the same kernel blocks per logical
block and the same kernel block size on both sides, and every class of regions read as one
whole, mergeable block from one remote rank (equal TP, or MLA). For such a pair of specs a
:class:`PlainRoute` holds those facts (:func:`plain_route` works it out on first use per spec
pair and placement, and keeps it), and a request costs only what its block IDs need:
validation, the tail trim (docs/domain.md §5), expansion, runs, and one set of byte ranges per
class. The helpers both paths share live here too: :func:`segments` and
:func:`geometry_classes`, each computed once per value.

The route handles the requests the general path would plan without surprise and gives up
(``None``) on the rest: an empty group, more local than remote IDs, a group count that does
not match. ``plan_pull`` then plans the request the general way, or refuses it with the general
path's error. Block IDs are validated by the same function in the same order (local, then
remote, group by group), so a refused ID is refused with the same error either way. The plans
are equal field by field (tests/blocks/test_route.py, on random requests).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from kvxferd.blocks.bounds import check_block_ids
from kvxferd.blocks.coalesce import Runs, find_runs, mergeable
from kvxferd.blocks.ranges import (
    Int64Array,
    Named,
    PullPlan,
    RegionRanges,
    SharedRanges,
    TransferPlan,
    frozen,
)
from kvxferd.blocks.tp import RankSegments, TPPosition, check_tp, region_segments, tp_ratio
from kvxferd.errors import InvalidRequest, SpecError
from kvxferd.layout.spec import KVCacheSpec, Region


@dataclass(frozen=True, eq=False)
class PlainGroup:
    """One KV group of a plain route: ``ppl`` kernel blocks per logical block on both sides,
    the logical block counts each side registered, and the names its errors use. ``step``:
    ``[[0, 1, ..., ppl - 1]]`` (read-only), what expansion adds to each ``L * ppl``."""

    ppl: int
    local_blocks: int
    remote_blocks: int
    local_field: str
    remote_field: str
    step: Int64Array


@dataclass(frozen=True)
class PlainClass:
    """Regions of one geometry (typically every layer): they read the very same ranges, one
    per run: local ``start * local_stride``, remote ``start * remote_stride``, ``length *
    block_len`` bytes. ``regions``: their indices (read-only); ``region``, ``name``: the
    first's."""

    group: int
    regions: Int64Array
    region: int
    name: str
    local_stride: int
    remote_stride: int
    block_len: int


@dataclass(frozen=True, eq=False)
class PlainRoute:
    """A pair of plain specs at one TP placement; :meth:`plan` plans a request."""

    local_tp: tuple[int, int]
    remote_tp: tuple[int, int]
    tp_ratio: int
    rank: int  # the one remote rank every class reads
    notify_ranks: tuple[int, ...]
    regions: tuple[Named, ...]  # the local spec's, in order
    groups: tuple[PlainGroup, ...]
    classes: tuple[PlainClass, ...]

    def plan(
        self,
        local_ids: Sequence[object],
        remote_ids: Sequence[object],
        max_ids: int,
    ) -> PullPlan | None:
        """The request's plan, equal to the general planner's, or None when this route does
        not handle it (the general path then plans it or words its error). Raises what
        :func:`~kvxferd.blocks.bounds.check_block_ids` raises for a bad ID list."""
        groups = self.groups
        if len(local_ids) != len(groups) or len(remote_ids) != len(groups):
            return None
        checked = [
            (
                check_block_ids(local_ids[g], pg.local_blocks, pg.local_field, max_ids=max_ids),
                check_block_ids(remote_ids[g], pg.remote_blocks, pg.remote_field, max_ids=max_ids),
            )
            for g, pg in enumerate(groups)
        ]
        runs: list[Runs] = []
        for pg, (lk, rk) in zip(groups, checked, strict=True):
            n_l, n_r = lk.shape[0], rk.shape[0]
            if n_l == 0 or n_l > n_r:
                return None
            if n_r > n_l:  # the local side holds the uncached tail: the last n_l remote IDs
                rk = rk[n_r - n_l :]  # noqa: PLW2901
            if pg.ppl > 1:  # logical -> kernel IDs (docs/domain.md §4), one broadcast each
                lk = (lk[:, None] * pg.ppl + pg.step).reshape(-1)  # noqa: PLW2901
                rk = (rk[:, None] * pg.ppl + pg.step).reshape(-1)  # noqa: PLW2901
            run = find_runs(lk, rk)
            for a in (run.local_ids, run.remote_ids, run.local_start, run.remote_start):
                frozen(a)
            runs.append(run)
        shared: list[SharedRanges] = []
        naive = 0
        for c in self.classes:
            run = runs[c.group]
            ranges = RegionRanges(
                c.region,
                c.name,
                frozen(run.local_start * c.local_stride),
                frozen(run.remote_start * c.remote_stride),
                frozen(run.length * c.block_len),
                coalesced=True,  # find_runs' runs are sorted and maximal
            )
            shared.append(SharedRanges(c.regions, ranges))
            naive += run.num_blocks * int(c.regions.shape[0])
        local_blocks = tuple(r.local_ids for r in runs)
        part = TransferPlan.of_classes(self.regions, tuple(shared), local_blocks, naive)
        return PullPlan(
            local_tp=self.local_tp,
            remote_tp=self.remote_tp,
            tp_ratio=self.tp_ratio,
            per_rank=MappingProxyType({self.rank: part}),
            notify_ranks=self.notify_ranks,
            local_kernel_blocks=local_blocks,
            remote_kernel_blocks=tuple(r.remote_ids for r in runs),
        )


@functools.lru_cache(maxsize=1024)
def segments(
    lr: Region,
    rr: Region,
    *,
    local_tp: TPPosition,
    remote_tp: TPPosition,
    num_kv_heads: int | None,
    field: str,
) -> tuple[RankSegments, ...]:
    """:func:`region_segments` of a region pair at a TP placement, computed once per peer:
    a pure function of these (hashable, immutable) values, so the cache is never stale. The
    arrays are shared by every pull from then on: read-only."""
    segs = region_segments(
        lr, rr, local_tp=local_tp, remote_tp=remote_tp, num_kv_heads=num_kv_heads, field=field
    )
    for seg in segs:
        for a in (seg.local_offset, seg.remote_offset, seg.length):
            frozen(a)
    return segs


@functools.lru_cache(maxsize=256)
def geometry_classes(
    local_ids: tuple[int, ...], remote_ids: tuple[int, ...]
) -> tuple[tuple[tuple[int, ...], Int64Array], ...]:
    """Region indices grouped by (local, remote) geometry id (``KVCacheSpec.geometry_ids``),
    each class and the classes in region order, each as a tuple and as a read-only array;
    once per pair of id tuples (value-keyed)."""
    classes: dict[tuple[int, int], list[int]] = {}
    for i, key in enumerate(zip(local_ids, remote_ids, strict=True)):
        members = classes.get(key)
        if members is None:
            classes[key] = [i]
        else:
            members.append(i)
    return tuple((tuple(m), frozen(np.array(m, dtype=np.int64))) for m in classes.values())


# Plain routes (kvxferd/blocks/route.py) by spec pair and placement; the specs are kept with
# their route, so the identities in a key stay theirs while it is here.
_ROUTES: dict[tuple[object, ...], tuple[KVCacheSpec, KVCacheSpec, PlainRoute | None]] = {}
MAX_ROUTES = 64


def plain_route(
    local: KVCacheSpec,
    remote: KVCacheSpec,
    local_tp: TPPosition,
    remote_tp: TPPosition,
    num_kv_heads: int | None,
) -> PlainRoute | None:
    """The plain route of this spec pair and placement, or None when it is not plain; worked
    out on first use and kept (at most :data:`MAX_ROUTES`, then forgotten all at once)."""
    try:
        key = (id(local), id(remote), *local_tp, *remote_tp, num_kv_heads)
        hit = _ROUTES.get(key)
    except TypeError:  # an unhashable placement: the general path words what is wrong
        return None
    if hit is not None and hit[0] is local and hit[1] is remote:
        return hit[2]
    try:
        route = _plain_route(local, remote, local_tp, remote_tp, num_kv_heads)
    except (InvalidRequest, SpecError):  # raised again by the general path, in its order
        route = None
    if len(_ROUTES) >= MAX_ROUTES:
        _ROUTES.clear()
    _ROUTES[key] = (local, remote, route)
    return route


def _plain_route(
    local: KVCacheSpec,
    remote: KVCacheSpec,
    local_tp: TPPosition,
    remote_tp: TPPosition,
    num_kv_heads: int | None,
) -> PlainRoute | None:
    """What :func:`plan_pull` would work out from the specs alone, when it is plain: every
    group attention with equal kernel blocks per logical block and kernel block sizes on both
    sides (paired 1:1 by kernel block, end-trimmed), every class read as one whole, mergeable
    block from a single remote rank."""
    check_tp(local_tp, "local_tp")
    check_tp(remote_tp, "remote_tp")
    ratio = tp_ratio(local_tp[1], remote_tp[1])
    if local.pairing != remote.pairing:  # regions that do not pair: the general path says why
        return None
    groups: list[PlainGroup] = []
    for g, (lg, rg) in enumerate(zip(local.groups, remote.groups, strict=True)):
        ppl = lg.ppl
        if (
            lg.kind is not rg.kind
            or lg.kind.is_state
            or lg.kernel_block_size != rg.kernel_block_size
            or rg.ppl != ppl
            or local.num_kernel_blocks(g) < local.num_logical_blocks(g) * ppl
            or remote.num_kernel_blocks(g) < remote.num_logical_blocks(g) * ppl
            or not local.regions_of(g)
        ):
            return None
        groups.append(
            PlainGroup(
                ppl,
                local.num_logical_blocks(g),
                remote.num_logical_blocks(g),
                f"groups[{g}].local_block_ids",
                f"groups[{g}].remote_block_ids",
                frozen(np.arange(ppl, dtype=np.int64)[None, :]),
            )
        )
    classes: list[PlainClass] = []
    ranks: set[int] = set()
    for members, indices in geometry_classes(local.geometry_ids, remote.geometry_ids):
        i = members[0]
        lr, rr = local.regions[i], remote.regions[i]
        segs = segments(
            lr,
            rr,
            local_tp=(local_tp[0], local_tp[1]),
            remote_tp=(remote_tp[0], remote_tp[1]),
            num_kv_heads=num_kv_heads,
            field=f"regions[{i}]",
        )
        if len(segs) != 1 or not mergeable(lr, rr, segs[0]):
            return None
        ranks.add(segs[0].remote_rank)
        block_len = int(segs[0].length[0])
        classes.append(PlainClass(lr.group, indices, i, lr.name, lr.stride, rr.stride, block_len))
    if len(ranks) != 1:
        return None
    (rank,) = ranks
    l_rank, l_size = local_tp
    notify = {rank} | {r for r in range(remote_tp[1]) if r % l_size == l_rank}
    return PlainRoute(
        local_tp=(local_tp[0], local_tp[1]),
        remote_tp=(remote_tp[0], remote_tp[1]),
        tp_ratio=ratio,
        rank=rank,
        notify_ranks=tuple(sorted(notify)),
        regions=local.regions,
        groups=tuple(groups),
        classes=tuple(classes),
    )
