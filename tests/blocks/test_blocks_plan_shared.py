"""plan_pull with the per-spec cached geometry: regions of one geometry share the very same
read-only arrays (kvxferd.transfer.descriptors.plan_runs dedupes on identity), every region's
ranges equal a one-region-at-a-time computation, and pairing errors read as before."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvxferd.blocks import plan_pull
from kvxferd.blocks import route as route_module
from kvxferd.blocks.coalesce import coalesce
from kvxferd.blocks.ranges import Int64Array, RegionRanges, TransferPlan
from kvxferd.blocks.tp import RankSegments, region_segments
from kvxferd.errors import InvalidRequest
from kvxferd.layout import preset
from kvxferd.layout.spec import KVCacheSpec


def _ids(spec: KVCacheSpec, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [
        [int(b) for b in rng.permutation(spec.num_logical_blocks(g))[:6]]
        for g in range(len(spec.groups))
    ]


def _padded(spec: KVCacheSpec, i: int) -> KVCacheSpec:
    """``spec`` with region ``i`` strided at twice its block length (same pairing)."""
    regions = list(spec.regions)
    regions[i] = replace(regions[i], block_stride=2 * regions[i].block_len)
    return KVCacheSpec(spec.model, spec.groups, tuple(regions))


def _arrays(rg: RegionRanges) -> tuple[Int64Array, Int64Array, Int64Array]:
    return rg.local_offset, rg.remote_offset, rg.length


CASES = [
    ("dense:num_blocks=64", None),
    ("dense:num_blocks=64,layout=HND", None),
    ("dense:num_blocks=64,cross_layer=1", None),
    ("hybrid:num_blocks=8", None),
    ("mla:num_blocks=32", None),
    ("fp8:num_blocks=32", None),
    ("dense:num_blocks=64", 5),
    ("fp8:num_blocks=32", 3),
    ("fp8:num_blocks=32", 5),
    ("hybrid:num_blocks=8", 2),
    ("hybrid:num_blocks=8", 7),
]


@pytest.mark.parametrize(("name", "pad"), CASES)
def test_same_geometry_regions_share_arrays_and_ranges_match_per_region(
    name: str, pad: int | None
) -> None:
    local = preset(name)
    remote = preset(name) if pad is None else _padded(preset(name), pad)  # a distinct object
    plan = plan_pull(local, remote, _ids(local, 1), _ids(remote, 2), prefix_caching=True)
    part = plan.per_rank[0]
    assert [rg.region for rg in part.ranges] == list(range(len(local.regions)))
    assert [rg.name for rg in part.ranges] == [r.name for r in local.regions]
    keys = list(zip(local.geometry_ids, remote.geometry_ids, strict=True))
    for i, a in enumerate(part.ranges):
        for j, b in enumerate(part.ranges):
            shared = [x is y for x, y in zip(_arrays(a), _arrays(b), strict=True)]
            assert shared == [keys[i] == keys[j]] * 3, (i, j)
        assert not a.length.flags.writeable
        lr, rr = local.regions[i], remote.regions[i]
        (seg,) = region_segments(lr, rr)
        g = lr.group
        want = coalesce(plan.local_kernel_blocks[g], plan.remote_kernel_blocks[g], lr, rr, seg)
        np.testing.assert_array_equal(a.local_offset, want.local_offset)
        np.testing.assert_array_equal(a.remote_offset, want.remote_offset)
        np.testing.assert_array_equal(a.length, want.length)


def test_pairing_mismatch_still_names_the_region() -> None:
    s = preset("fp8:num_blocks=8")
    regions = list(s.regions)
    regions[6] = replace(regions[6], name="renamed")
    other = KVCacheSpec(s.model, s.groups, tuple(regions))
    with pytest.raises(InvalidRequest) as e:
        plan_pull(s, other, [[1], [1]], [[1], [1]], prefix_caching=False)
    assert e.value.field == "regions[6]"
    assert e.value.message == (
        "region 6 does not pair: local 'layer.6' (group 0), remote 'renamed' (group 0)"
    )
    assert e.value.fix == "both peers must register the same regions in the same order"
    shorter = KVCacheSpec(s.model, s.groups, s.regions[:-1])
    with pytest.raises(InvalidRequest) as e:
        plan_pull(s, shorter, [[1], [1]], [[1], [1]], prefix_caching=False)
    assert e.value.field == "regions"


def test_region_segments_are_prepared_once_per_peer_and_read_only() -> None:
    local = preset("dense:num_blocks=16,layout=HND,num_kv_heads=4").regions[0]
    remote = preset("dense:num_blocks=16,layout=HND,num_kv_heads=8").regions[0]

    def prepared() -> tuple[RankSegments, ...]:
        return route_module.segments(
            local, remote, local_tp=(1, 2), remote_tp=(0, 1), num_kv_heads=None, field="r"
        )

    segs = prepared()
    assert segs is prepared()
    direct = region_segments(local, remote, local_tp=(1, 2), remote_tp=(0, 1))
    assert len(segs) == len(direct) == 1 and not segs[0].whole_block
    for got, want in zip(segs, direct, strict=True):
        assert got.remote_rank == want.remote_rank
        for a, b in zip(_seg_arrays(got), _seg_arrays(want), strict=True):
            np.testing.assert_array_equal(a, b)
            assert not a.flags.writeable


def _seg_arrays(seg: RankSegments) -> tuple[Int64Array, Int64Array, Int64Array]:
    return seg.local_offset, seg.remote_offset, seg.length


@pytest.mark.parametrize(("name", "pad"), CASES)
def test_the_plans_shared_groups_cover_every_nonempty_region_once(
    name: str, pad: int | None
) -> None:
    """TransferPlan.shared: every non-empty region in exactly one group, the members of a group
    sharing all three arrays and regions of different arrays in different groups, groups in
    region order; nbytes counts every region's bytes."""
    local = preset(name)
    remote = _padded(local, pad) if pad is not None else local
    ids = _ids(local, seed=len(name) + (pad or 0))
    for part in plan_pull(local, remote, ids, ids, prefix_caching=False).per_rank.values():
        groups = part.shared
        members = [rr.region for g in groups for rr in g]
        assert sorted(members) == [rr.region for rr in part.ranges if rr.num_ranges]
        for g in groups:
            assert [rr.region for rr in g] == sorted(rr.region for rr in g)
            assert all(a is b for rr in g for a, b in zip(_arrays(rr), _arrays(g[0]), strict=True))
        firsts = [tuple(id(a) for a in _arrays(g[0])) for g in groups]
        assert len(set(firsts)) == len(firsts)
        assert [g[0].region for g in groups] == sorted(g[0].region for g in groups)
        assert part.nbytes == sum(int(rr.length.sum()) for rr in part.ranges)
        # The planner hands its classes over (TransferPlan.of_classes): the ones found by
        # identity in a plan made from the same ranges, with the same sizes.
        found = TransferPlan(part.ranges, part.local_kernel_blocks, part.naive_descriptors)
        assert [[rr.region for rr in g] for g in groups] == [
            [rr.region for rr in g] for g in found.shared
        ]
        assert [c.regions.tolist() for c in part.classes] == [
            c.regions.tolist() for c in found.classes
        ]
        assert (part.nbytes, part.num_ranges) == (found.nbytes, found.num_ranges)
        assert part.num_ranges == sum(rr.num_ranges for rr in part.ranges)
        # Every region of the pool is listed, region i at index i under its own name.
        assert [(rr.region, rr.name) for rr in part.ranges] == [
            (i, r.name) for i, r in enumerate(local.regions)
        ]
        assert all(not c.regions.flags.writeable for c in part.classes)


def test_a_region_sharing_anothers_arrays_is_an_ordinary_frozen_record() -> None:
    """RegionRanges.sharing (the planner's per-layer copies): the given region and name over the
    very arrays of the first, equal to one built the checked way, and still frozen."""
    a = np.arange(3, dtype=np.int64)
    first = RegionRanges(0, "layer.0", a, a + 10, a + 1)
    other = RegionRanges.sharing(7, "layer.7", first)
    assert (other.region, other.name) == (7, "layer.7")
    assert all(x is y for x, y in zip(_arrays(other), _arrays(first), strict=True))
    assert other.num_ranges == 3 and other.nbytes == first.nbytes == 6
    assert repr(other) == repr(RegionRanges(7, "layer.7", *_arrays(first)))
    with pytest.raises(AttributeError):
        other.name = "x"  # type: ignore[misc]


def test_a_planned_pull_builds_its_per_region_ranges_only_when_asked() -> None:
    """The hot paths (sizes, KERNEL pieces, DIRECT's runs) read the classes; the per-region
    ranges of a 32-layer plan are built once, on first use, and the plan cannot be changed."""
    from kvxferd.transfer.descriptors import run_groups

    local = preset("dense:num_blocks=64")
    part = plan_pull(local, local, [[1, 2, 9]], [[4, 5, 6]], prefix_caching=False).per_rank[0]
    assert part.nbytes > 0 and part.num_ranges == 2 * len(local.regions) and not part.empty
    groups = run_groups(part)
    assert isinstance(groups, list) and groups[0].regions is part.classes[0].regions
    assert "ranges" not in part.__dict__
    assert part.ranges is part.ranges and len(part.ranges) == len(local.regions)
    with pytest.raises(AttributeError, match="immutable"):
        part.naive_descriptors = 0  # type: ignore[misc]
