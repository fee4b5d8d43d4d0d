"""The CUDA staging kernels against the plain-torch twin, byte for byte (GPU only)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvxferd.errors import BlockRangeError
from kvxferd.kernels import BackendName, HeadOrder, KVPermute, active_backend, row_bytes, twin
from kvxferd.layout.spec import Layout
from tests.kernels.helpers import kv_tensors, random_bytes, views

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]

LAYOUTS = [Layout.NHD, Layout.HND, Layout.CROSS_LAYER_NHD, Layout.CROSS_LAYER_HND]
# Llama-like block, small pool: (num_blocks, 2, 16 tokens, 8 heads, 128) bf16 = 64 KiB a block
SHAPE = (256, 2, 16, 8, 128)


@pytest.fixture(scope="module")
def cuda_ops() -> object:
    backend = active_backend()
    # On a GPU machine a failed build is a failure, not a skip.
    assert backend.name is BackendName.CUDA, backend.describe()
    from kvxferd.kernels import cuda_ops as ops

    return ops


def _poisoned(regions: list[torch.Tensor], n: int) -> torch.Tensor:
    return torch.full((n * row_bytes(regions),), 0xA5, dtype=torch.uint8, device="cuda")


def _permute_for(layout: Layout, on: bool) -> KVPermute | None:
    if not on:
        return None
    src = HeadOrder.HND if layout.head_major else HeadOrder.NHD
    return KVPermute(src, SHAPE[2], SHAPE[3], SHAPE[4] * 2)


@pytest.mark.parametrize("permute", [False, True], ids=["plain", "permute"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_and_scatter_match_the_twin(cuda_ops: object, layout: Layout, permute: bool) -> None:
    ops = cuda_ops
    gen = torch.Generator().manual_seed(11)
    rng = np.random.default_rng(11)
    src = views(kv_tensors(layout, layers=6, gen=gen, device="cuda", shape=SHAPE), layout)
    perm = _permute_for(layout, permute)
    for n in (1, 37, 200):
        sids = rng.choice(SHAPE[0], n, replace=False)
        dids = rng.choice(SHAPE[0], n, replace=False)
        want, got = _poisoned(src, n), _poisoned(src, n)
        twin.gather_blocks(src, sids, want, permute=perm)
        ops.gather_blocks(src, sids, got, permute=perm)  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"gather n={n}"
        dst_twin = views(kv_tensors(layout, layers=6, gen=gen, device="cuda", shape=SHAPE), layout)
        dst_cuda = [d.clone() for d in dst_twin]
        back = perm.reverse() if perm else None
        twin.scatter_blocks(dst_twin, dids, want, permute=back)
        ops.scatter_blocks(dst_cuda, dids, want, permute=back)  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        for a, b in zip(dst_twin, dst_cuda, strict=True):
            assert torch.equal(a, b), f"scatter n={n}"
        for s, d in zip(src, dst_cuda, strict=True):  # and the round trip is exact
            assert torch.equal(d[torch.from_numpy(dids).cuda()], s[torch.from_numpy(sids).cuda()])


def test_chunked_launches_on_a_side_stream_equal_one(cuda_ops: object) -> None:
    ops = cuda_ops
    gen = torch.Generator().manual_seed(12)
    rng = np.random.default_rng(12)
    src = views(kv_tensors(Layout.NHD, layers=4, gen=gen, device="cuda", shape=SHAPE), Layout.NHD)
    ids = rng.choice(SHAPE[0], 128, replace=False)
    whole, parts = _poisoned(src, 128), _poisoned(src, 128)
    ops.gather_blocks(src, ids, whole)  # type: ignore[attr-defined]
    rb = row_bytes(src)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for a in range(0, 128, 40):
            b = min(a + 40, 128)
            ops.gather_blocks(src, ids[a:b], parts[a * rb : b * rb])  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    assert torch.equal(whole, parts)


@pytest.mark.parametrize("shift", [1, 2, 4, 8])
def test_unaligned_regions_use_narrower_vectors(cuda_ops: object, shift: int) -> None:
    ops = cuda_ops
    gen = torch.Generator().manual_seed(13)
    base = random_bytes(torch.empty(64, 1024 + 64, dtype=torch.uint8, device="cuda"), gen)
    regions = [base[:, shift : shift + 1000], base[:, 16 : 16 + 48]]
    ids = np.array([5, 0, 63, 17, 9])
    got, want = _poisoned(regions, 5), _poisoned(regions, 5)
    width = ops.vector_width(regions, ids, got)  # type: ignore[attr-defined]
    assert width == min(shift, 8)
    ops.gather_blocks(regions, ids, got)  # type: ignore[attr-defined]
    twin.gather_blocks(regions, ids, want)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def test_aligned_llama_blocks_use_16_byte_vectors(cuda_ops: object) -> None:
    gen = torch.Generator().manual_seed(14)
    src = views(kv_tensors(Layout.NHD, layers=2, gen=gen, device="cuda", shape=SHAPE), Layout.NHD)
    out = _poisoned(src, 3)
    assert cuda_ops.vector_width(src, [1, 2, 3], out) == 16  # type: ignore[attr-defined]


def test_bad_ids_raise_before_launch(cuda_ops: object) -> None:
    ops = cuda_ops
    gen = torch.Generator().manual_seed(15)
    src = views(kv_tensors(Layout.NHD, layers=2, gen=gen, device="cuda", shape=SHAPE), Layout.NHD)
    out = _poisoned(src, 2)
    with pytest.raises(BlockRangeError):
        ops.gather_blocks(src, [0, SHAPE[0]], out)  # type: ignore[attr-defined]
    # the C++ launcher refuses on its own too (returns the message), for callers that bypass
    # the wrapper, and launches nothing
    raw: Callable[..., str] = torch.ops.kvxferd.gather_blocks
    assert "outside region" in raw(src, torch.tensor([0, SHAPE[0]]), out, [])
    assert "CPU tensor" in raw(src, torch.tensor([0, 1], device="cuda"), out, [])
    assert "staging has" in raw(src, torch.tensor([0]), out, [])
    assert raw(src, torch.tensor([0, 1]), out, [4, 8, 0])  # non-positive permute value
    torch.cuda.synchronize()
    assert bool((out == 0xA5).all())
