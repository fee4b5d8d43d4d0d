"""The plain-torch twin (CPU): round trips, the NHD/HND permute, and input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.errors import BlockRangeError, InvalidRequest
from kvxferd.kernels import (
    BackendName,
    HeadOrder,
    KVPermute,
    active_backend,
    block_view,
    gather_blocks,
    row_bytes,
    scatter_blocks,
    twin,
)
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import Layout, Region
from tests.kernels.helpers import SHAPE, kv_tensors, random_bytes, views

LAYOUTS = [Layout.NHD, Layout.HND, Layout.CROSS_LAYER_NHD, Layout.CROSS_LAYER_HND]


def _staging(regions: list[torch.Tensor], n: int) -> torch.Tensor:
    return torch.full((n * row_bytes(regions),), 0xA5, dtype=torch.uint8)


def _ids(rng: np.random.Generator, num_blocks: int, n: int) -> np.ndarray:
    return rng.choice(num_blocks, n, replace=False).astype(np.int64)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_view_is_a_view_of_whole_blocks(layout: Layout) -> None:
    gen = torch.Generator().manual_seed(1)
    ts = kv_tensors(layout, layers=3, gen=gen)
    vs = views(ts, layout)
    block = SHAPE[1] * SHAPE[2] * SHAPE[3] * SHAPE[4] * 2
    per = block * (3 if layout.is_cross_layer else 1)
    for t, v in zip(ts, vs, strict=True):
        assert v.shape == (SHAPE[0], per) and v.data_ptr() == t.data_ptr()
    # the block view's row 5 holds exactly block 5's bytes
    phys = ts[0].permute(layout.stride_order(ts[0].dim()))
    assert torch.equal(vs[0][5], phys[5].contiguous().view(torch.uint8).view(-1))


def test_block_view_refuses_non_blocks_first_memory() -> None:
    t = torch.zeros(SHAPE, dtype=torch.bfloat16).transpose(0, 1)  # blocks not outermost
    with pytest.raises(InvalidRequest, match="blocks-first"):
        block_view(t.contiguous().transpose(0, 1), Layout.NHD)
    with pytest.raises(InvalidRequest, match="5-D"):
        block_view(torch.zeros(4, 4), Layout.NHD)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_then_scatter_round_trips_bytes(layout: Layout) -> None:
    gen = torch.Generator().manual_seed(2)
    rng = np.random.default_rng(2)
    src = views(kv_tensors(layout, layers=4, gen=gen), layout)
    dst = views(kv_tensors(layout, layers=4, gen=gen), layout)
    before = [d.clone() for d in dst]
    n = 9
    sids, dids = _ids(rng, SHAPE[0], n), _ids(rng, SHAPE[0], n)
    staging = _staging(src, n)
    gather_blocks(src, sids, staging)
    rows = staging.view(n, -1)
    off = 0
    for r in src:  # row i = every region's block sids[i], in region order
        assert torch.equal(rows[:, off : off + r.shape[1]], r[torch.from_numpy(sids)])
        off += r.shape[1]
    scatter_blocks(dst, dids, staging)
    for s, d, b in zip(src, dst, before, strict=True):
        assert torch.equal(d[torch.from_numpy(dids)], s[torch.from_numpy(sids)])
        untouched = np.setdiff1d(np.arange(SHAPE[0]), dids)
        assert torch.equal(d[torch.from_numpy(untouched)], b[torch.from_numpy(untouched)])


def test_chunks_of_rows_compose_to_the_whole() -> None:
    gen = torch.Generator().manual_seed(3)
    rng = np.random.default_rng(3)
    src = views(kv_tensors(Layout.NHD, layers=3, gen=gen), Layout.NHD)
    ids = _ids(rng, SHAPE[0], 10)
    whole, parts = _staging(src, 10), _staging(src, 10)
    gather_blocks(src, ids, whole)
    rb = row_bytes(src)
    for a, b in [(0, 3), (3, 4), (4, 10)]:
        gather_blocks(src, ids[a:b], parts[a * rb : b * rb])
    assert torch.equal(whole, parts)


def test_padded_block_stride() -> None:
    gen = torch.Generator().manual_seed(4)
    base = random_bytes(torch.empty(16, 96, dtype=torch.uint8), gen)
    region = base[:, :64]  # 64-byte blocks every 96 bytes
    out = _staging([region], 5)
    gather_blocks([region], [3, 0, 15, 7, 8], out)
    assert torch.equal(out.view(5, 64), base[[3, 0, 15, 7, 8], :64])
    dst_base = torch.zeros(16, 96, dtype=torch.uint8)
    scatter_blocks([dst_base[:, :64]], [1, 2, 3, 4, 5], out)
    assert torch.equal(dst_base[1:6, :64], base[[3, 0, 15, 7, 8], :64])
    assert not dst_base[:, 64:].any()


@pytest.mark.parametrize(("layout", "other"), [(Layout.NHD, Layout.HND), (Layout.HND, Layout.NHD)])
def test_permute_matches_torch_permute_and_round_trips(layout: Layout, other: Layout) -> None:
    gen = torch.Generator().manual_seed(5)
    rng = np.random.default_rng(5)
    ts = kv_tensors(layout, layers=2, gen=gen)
    src = views(ts, layout)
    region = Region("l0", 0, KVDType.BF16, layout, SHAPE)
    perm = KVPermute.from_region(region)
    assert perm.src is (HeadOrder.HND if layout is Layout.HND else HeadOrder.NHD)
    n = 6
    ids = _ids(rng, SHAPE[0], n)
    staging = _staging(src, n)
    gather_blocks(src, ids, staging, permute=perm)
    # staging row i, region 0: block ids[i] laid out in the *other* order
    expect = ts[0][torch.from_numpy(ids)].permute(0, *other.stride_order(5)[1:])
    got = staging.view(n, -1)[:, : src[0].shape[1]]
    assert torch.equal(got, expect.contiguous().view(torch.uint8).reshape(n, -1))
    # scatter back with the reverse permute into fresh tensors of the original layout
    back = views(kv_tensors(layout, layers=2, gen=gen), layout)
    scatter_blocks(back, ids, staging, permute=perm.reverse())
    for s, b in zip(src, back, strict=True):
        assert torch.equal(b[torch.from_numpy(ids)], s[torch.from_numpy(ids)])


def test_permute_on_cross_layer_blocks_swaps_every_half() -> None:
    gen = torch.Generator().manual_seed(6)
    ts = kv_tensors(Layout.CROSS_LAYER_NHD, layers=3, gen=gen)
    src = views(ts, Layout.CROSS_LAYER_NHD)
    perm = KVPermute(HeadOrder.NHD, SHAPE[2], SHAPE[3], SHAPE[4] * 2)
    staging = _staging(src, 2)
    gather_blocks(src, [4, 11], staging, permute=perm)
    # logical (L, NB, 2, T, H, D) -> block-major HND: (NB, L, 2, H, T, D)
    want = ts[0][:, [4, 11]].permute(1, 0, 2, 4, 3, 5).contiguous()
    assert torch.equal(staging, want.view(torch.uint8).view(-1))


def test_out_of_range_and_repeated_ids_raise_before_anything_runs() -> None:
    gen = torch.Generator().manual_seed(7)
    src = views(kv_tensors(Layout.NHD, layers=2, gen=gen), Layout.NHD)
    small = src[1][:10]  # a region with fewer blocks: IDs must fit every region
    staging = _staging(src, 3)
    for bad in ([0, 24, 1], [0, -1, 1]):
        with pytest.raises(BlockRangeError, match="outside regions"):
            gather_blocks(src, bad, staging)
        with pytest.raises(BlockRangeError):
            scatter_blocks(src, bad, staging)
    with pytest.raises(BlockRangeError, match=r"regions\[1\]"):
        gather_blocks([src[0], small], [0, 12, 1], staging)
    assert bool((staging == 0xA5).all())
    before = [s.clone() for s in src]
    with pytest.raises(BlockRangeError, match="repeat"):
        scatter_blocks(src, [1, 2, 1], staging)
    assert all(torch.equal(a, b) for a, b in zip(src, before, strict=True))


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda s, r, i: (s, r, i[:2]), "expected 2 IDs"),
        (lambda s, r, i: (s.view(torch.int8), r, i), "uint8"),
        (lambda s, r, i: (s, [x.view(torch.int16) for x in r], i), "2-D uint8"),
        (lambda s, r, i: (s, r, np.array([0.0, 1.0, 2.0])), "integers"),
        (lambda s, r, i: (s, r, np.array([[0, 1, 2]])), "1-D"),
        (lambda s, r, i: (s, [], i), "no regions"),
        (lambda s, r, i: (s, [x[:, :8].t() for x in r], i), "2-D uint8|strides"),
    ],
)
def test_malformed_inputs_are_refused(mutate: object, match: str) -> None:
    gen = torch.Generator().manual_seed(8)
    src = views(kv_tensors(Layout.NHD, layers=2, gen=gen), Layout.NHD)
    staging, regions, ids = mutate(_staging(src, 3), src, np.array([0, 1, 2]))  # type: ignore[operator]
    with pytest.raises(InvalidRequest, match=match):
        gather_blocks(regions, ids, staging)


def test_permute_needs_whole_halves() -> None:
    gen = torch.Generator().manual_seed(9)
    src = views(kv_tensors(Layout.NHD, layers=1, gen=gen), Layout.NHD)
    with pytest.raises(InvalidRequest, match="halves"):
        gather_blocks(src, [0], _staging(src, 1), permute=KVPermute(HeadOrder.NHD, 3, 2, 32))


def test_empty_request_is_a_no_op() -> None:
    gen = torch.Generator().manual_seed(10)
    src = views(kv_tensors(Layout.NHD, layers=1, gen=gen), Layout.NHD)
    out = torch.empty(0, dtype=torch.uint8)
    assert gather_blocks(src, np.array([], dtype=np.int64), out) is out
    scatter_blocks(src, [], out)


@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 3),
    num_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 4]),
    heads=st.sampled_from([1, 2, 3]),
    head_size=st.sampled_from([1, 4, 8]),
    dtype=st.sampled_from([torch.uint8, torch.float16, torch.float32]),
    seed=st.integers(0, 2**16),
    permute=st.booleans(),
)
def test_round_trip_any_geometry(
    *,
    layers: int,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_size: int,
    dtype: torch.dtype,
    seed: int,
    permute: bool,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    shape = (num_blocks, 2, block_size, heads, head_size)
    src = views(
        kv_tensors(Layout.NHD, layers=layers, gen=gen, dtype=dtype, shape=shape), Layout.NHD
    )
    dst = [torch.zeros_like(s) for s in src]
    n = int(rng.integers(0, num_blocks + 1))
    sids, dids = _ids(rng, num_blocks, n), _ids(rng, num_blocks, n)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    perm = KVPermute(HeadOrder.NHD, block_size, heads, head_size * itemsize) if permute else None
    staging = _staging(src, n)
    twin.gather_blocks(src, sids, staging, permute=perm)
    twin.scatter_blocks(dst, dids, staging, permute=perm.reverse() if perm else None)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[torch.from_numpy(dids)], s[torch.from_numpy(sids)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only choice")
def test_cpu_machine_selects_the_twin_and_says_why() -> None:
    b = active_backend()
    assert b.name is BackendName.TORCH and b.reason
    assert "kernels=torch" in b.describe()
