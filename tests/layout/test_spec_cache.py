"""The per-spec derived data (cached once per spec) equals the direct computation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.layout import preset
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import GroupKind, KVCacheSpec, KVGroup, Layout, MemoryType, Region

PRESETS = [
    "dense",
    "dense:layout=HND",
    "dense:cross_layer=1",
    "hybrid",
    "hybrid:ppl=34,num_blocks=4",
    "mla",
    "fp8",
]


def _check(spec: KVCacheSpec) -> None:
    n = len(spec.groups)
    for g in range(n):
        direct = tuple(r for r in spec.regions if r.group == g)
        assert spec.regions_of(g) == direct
        assert spec.num_kernel_blocks(g) == direct[0].num_blocks
        assert spec.num_logical_blocks(g) == direct[0].num_blocks // spec.groups[g].ppl
    for missing in (-1, n, n + 5):
        assert spec.regions_of(missing) == ()
        with pytest.raises(IndexError):
            spec.num_kernel_blocks(missing)
        with pytest.raises(IndexError):
            spec.num_logical_blocks(missing)
    keys = [(r.group, r.layout, r.dtype, r.shape, r.block_stride) for r in spec.regions]
    ids = spec.geometry_ids
    assert len(ids) == len(spec.regions)
    for i in range(len(keys)):
        for j in range(len(keys)):
            assert (ids[i] == ids[j]) == (keys[i] == keys[j])
    first_seen = list(dict.fromkeys(ids))
    assert first_seen == list(range(len(first_seen)))  # small ints, in region order
    assert spec.pairing == (n, tuple((r.name, r.group) for r in spec.regions))


@pytest.mark.parametrize("name", PRESETS)
def test_cached_spec_data_matches_direct_computation(name: str) -> None:
    spec = preset(name)
    _check(spec)
    _check(spec)  # second read: from the cache
    vram = spec.with_memory(MemoryType.VRAM)  # a new spec: its own derived data
    _check(vram)
    assert vram.geometry_ids == spec.geometry_ids and vram.pairing == spec.pairing


def test_caching_leaves_equality_hash_and_dict_form_alone() -> None:
    a, b = preset("fp8"), preset("fp8")
    before = (hash(a), a.to_dict(), a.digest())
    _check(a)
    assert a == b and hash(a) == hash(b) == before[0]
    assert (a.to_dict(), a.digest()) == before[1:]
    assert a.geometry_ids == (0, 0, 0, 1) * 8  # every 4th layer: a bf16 sliding layer


def test_geometry_ids_split_on_every_geometry_field() -> None:
    g = (
        KVGroup("a", GroupKind.FULL_ATTENTION, 16, 16),
        KVGroup("b", GroupKind.SLIDING_WINDOW, 16, 16),
    )
    shape = (8, 2, 16, 2, 4)
    regions = (
        Region("r0", 0, KVDType.BF16, Layout.NHD, shape),
        Region("r1", 0, KVDType.BF16, Layout.NHD, shape, MemoryType.VRAM),  # memory: same
        Region("r2", 1, KVDType.BF16, Layout.NHD, shape),  # group
        Region("r3", 0, KVDType.FP16, Layout.NHD, shape),  # dtype
        Region("r4", 0, KVDType.BF16, Layout.HND, shape),  # layout
        Region("r5", 0, KVDType.BF16, Layout.NHD, (8, 2, 16, 4, 2)),  # shape
        Region("r6", 0, KVDType.BF16, Layout.NHD, shape, block_stride=4096),  # stride
        Region("r7", 0, KVDType.BF16, Layout.NHD, shape),
    )
    spec = KVCacheSpec("m", g, regions)
    assert spec.geometry_ids == (0, 0, 1, 2, 3, 4, 5, 0)
    _check(spec)


_KINDS = st.sampled_from(
    [(KVDType.BF16, Layout.NHD), (KVDType.FP16, Layout.NHD), (KVDType.BF16, Layout.HND)]
)


@settings(deadline=None, max_examples=60)
@given(
    regions=st.lists(
        st.tuples(st.integers(0, 1), _KINDS, st.sampled_from([1, 2]), st.sampled_from([0, 8192])),
        min_size=2,
        max_size=12,
    )
)
def test_cached_spec_data_on_random_specs(
    regions: list[tuple[int, tuple[KVDType, Layout], int, int]],
) -> None:
    groups = (
        KVGroup("a", GroupKind.FULL_ATTENTION, 32, 16),
        KVGroup("b", GroupKind.SLIDING_WINDOW, 16, 16),
    )
    regs = [
        Region(f"r{i}", grp, dt, lay, (8, 2, 16, heads, 64), block_stride=stride)
        for i, (grp, (dt, lay), heads, stride) in enumerate(regions)
    ]
    regs += [Region(f"g{g}", g, KVDType.BF16, Layout.NHD, (8, 2, 16, 1, 64)) for g in (0, 1)]
    _check(KVCacheSpec("m", groups, tuple(regs)))
