"""Heterogeneous kernel block sizes (docs/domain.md §5 rule 3): plans re-block at the chunk.

The executor fills every remote element with a code of what it holds (layer, K/V half, global
head, prompt token position, element) and checks, after running the plan, that every local
element holds the code of the same (layer, half, head, position, element), and that elements
whose position the pull does not cover are untouched.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from blocks_helpers import FA, MLA, PROPS, execute_all, spec
from hypothesis import assume, given
from hypothesis import strategies as st

from kvxferd.blocks import kv_head_range, plan_pull
from kvxferd.blocks.reblock import chunk_tokens, compatible_kernel_sizes, merge_adjacent
from kvxferd.errors import SpecError
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import KVCacheSpec, KVGroup, Layout, Region
from kvxferd.peers.compat import PeerInfo, check_compatible

U32 = npt.NDArray[np.uint32]
I64 = npt.NDArray[np.int64]
LAYERS, HEAD_SIZE, LATENT, TOTAL_HEADS, NB_LOGICAL = 2, 2, 3, 2, 6


def _region(layout: Layout, kernel: int, heads: int, nb_kernel: int) -> Region:
    if layout is Layout.MLA:
        return Region("r", 0, KVDType.FP32, layout, (nb_kernel, kernel, LATENT))
    inner = (2, kernel, heads, HEAD_SIZE)
    shape = (LAYERS, nb_kernel, *inner) if layout.is_cross_layer else (nb_kernel, *inner)
    return Region("r", 0, KVDType.FP32, layout, shape)


def _side(layout: Layout, kernel: int, logical: int, heads: int) -> KVCacheSpec:
    kind = MLA if layout is Layout.MLA else FA
    g = KVGroup("g", kind, logical_block_size=logical, kernel_block_size=kernel)
    return spec([g], [_region(layout, kernel, heads, NB_LOGICAL * (logical // kernel))])


def _logical_codes(r: Region, pos: I64, first_head: int) -> U32:
    """Codes in the region's logical shape; ``pos[k, t]`` is kernel block k's token t's prompt
    position (-1: not part of the prompt, code 0)."""
    if r.layout is Layout.MLA:
        d = np.arange(LATENT)
        code = (pos[:, :, None] * LATENT + d[None, None, :]) + 1
        return np.where(pos[:, :, None] >= 0, code, 0).astype(np.uint32)
    heads = np.arange(r.num_kv_heads) + first_head
    layer = np.arange(r.num_layers)[:, None, None, None, None, None]
    half = np.arange(2)[None, None, :, None, None, None]
    p = pos[None, :, None, :, None, None]
    h = heads[None, None, None, None, :, None]
    d = np.arange(HEAD_SIZE)[None, None, None, None, None, :]
    code = ((((layer * 2 + half) * TOTAL_HEADS + h) * 4096 + p) * HEAD_SIZE + d) + 1
    full = np.where(p >= 0, code, 0).astype(np.uint32)  # (layers, nb, 2, tokens, heads, dim)
    return full if r.layout.is_cross_layer else full[0]


def _physical_bytes(r: Region, codes: U32) -> npt.NDArray[np.uint8]:
    return np.ascontiguousarray(codes.transpose(r.stride_order)).view(np.uint8).reshape(-1)


def _from_bytes(r: Region, buf: npt.NDArray[np.uint8]) -> U32:
    order = r.stride_order
    phys_shape = tuple(r.shape[i] for i in order)
    arr = buf.view(np.uint32).reshape(phys_shape)
    return arr.transpose(np.argsort(order))


def _positions(g: KVGroup, ids: list[int], first_pos: list[int], nb_kernel: int) -> I64:
    """Per kernel block and token: the prompt position it holds (-1 where none)."""
    pos = np.full((nb_kernel, g.kernel_block_size), -1, dtype=np.int64)
    t = np.arange(g.kernel_block_size)
    for logical, start in zip(ids, first_pos, strict=True):
        for j in range(g.ppl):
            pos[logical * g.ppl + j] = start + j * g.kernel_block_size + t
    return pos


@PROPS
@given(
    chunk=st.sampled_from([1, 2, 4]),
    ratio=st.sampled_from([2, 3, 4]),
    local_coarse=st.booleans(),
    m_local=st.integers(1, 2),
    m_remote=st.integers(1, 2),
    layout=st.sampled_from(list(Layout.__members__.values())),
    tp=st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2)]),
    local_rank_seed=st.integers(0, 1),
    prefix_caching=st.booleans(),
    data=st.data(),
)
def test_reblocked_plans_move_equal_tokens(
    *,
    chunk: int,
    ratio: int,
    local_coarse: bool,
    m_local: int,
    m_remote: int,
    layout: Layout,
    tp: tuple[int, int],
    local_rank_seed: int,
    prefix_caching: bool,
    data: st.DataObject,
) -> None:
    assume(layout is not Layout.STATE)
    l_size, r_size = tp
    sliced = layout is not Layout.MLA and l_size != r_size
    assume(not sliced or layout.head_major)
    if prefix_caching:
        m_remote = m_local  # equal logical sizes: the only re-blocked pairing prefix caching allows
    k_local, k_remote = (chunk * ratio, chunk) if local_coarse else (chunk, chunk * ratio)
    lg_local, lg_remote = chunk * ratio * m_local, chunk * ratio * m_remote
    l_rank = local_rank_seed % l_size
    l_first, l_count = kv_head_range(l_rank, l_size, TOTAL_HEADS)
    r_count = kv_head_range(0, r_size, TOTAL_HEADS)[1]
    local = _side(layout, k_local, lg_local, l_count)
    remote = _side(layout, k_remote, lg_remote, r_count)

    n_l = data.draw(st.integers(0 if prefix_caching else 1, 3), label="n_local")
    if prefix_caching:
        n_r = n_l + data.draw(st.integers(0, 2), label="cached")
    else:
        n_r = -(-n_l * lg_local // lg_remote)  # the fewest remote blocks covering the prompt
    lids = data.draw(st.permutations(range(NB_LOGICAL)), label="lids")[:n_l]
    rids = data.draw(st.permutations(range(NB_LOGICAL)), label="rids")[:n_r]
    r_first = [j * lg_remote for j in range(n_r)]
    if prefix_caching:
        l_first_pos = [(n_r - n_l + i) * lg_local for i in range(n_l)]
        covered = n_r * lg_remote
    else:
        l_first_pos = [i * lg_local for i in range(n_l)]
        covered = min(n_l * lg_local, n_r * lg_remote)

    plan = plan_pull(
        local,
        remote,
        [lids],
        [rids],
        prefix_caching=prefix_caching,
        local_tp=(l_rank, l_size),
        remote_tp=(0, r_size),
    )

    rr, lr = remote.regions[0], local.regions[0]
    rpos = _positions(remote.groups[0], rids, r_first, rr.num_blocks)
    remote_bufs = {}
    for rank in range(r_size):
        first = 0 if layout is Layout.MLA else kv_head_range(rank, r_size, TOTAL_HEADS)[0]
        remote_bufs[rank] = [_physical_bytes(rr, _logical_codes(rr, rpos, first))]
    dst = np.zeros(lr.nbytes, dtype=np.uint8)
    execute_all(plan.per_rank, [dst], remote_bufs)

    lpos = _positions(local.groups[0], lids, l_first_pos, lr.num_blocks)
    lpos = np.where(lpos < covered, lpos, -1)
    want = _logical_codes(lr, lpos, l_first)
    got = _from_bytes(lr, dst)
    assert np.array_equal(got, want)
    blocks = {int(b) for b in plan.local_kernel_blocks[0]}
    assert blocks == {int(k) for k in np.flatnonzero((lpos >= 0).any(axis=1))}


def test_worked_example_kernel_16_against_32() -> None:
    """Logical blocks of 64 tokens; local kernel 16 (ppl 4), remote kernel 32 (ppl 2), NHD,
    one layer: local logical 1 = kernel blocks 4..7, remote logical 2 = kernel blocks 4..5.
    Chunk pairs (16 tokens): (4, 4.0), (5, 4.1), (6, 5.0), (7, 5.1); each moves a K and a V
    piece of 16 tokens x 2 heads x 2 elements x 4 bytes = 256 bytes: 8 naive ranges."""
    local = _side(Layout.NHD, 16, 64, 2)
    remote = _side(Layout.NHD, 32, 64, 2)
    plan = plan_pull(local, remote, [[1]], [[2]], prefix_caching=True)
    rg = plan.per_rank[0].ranges[0]
    lb, rb = 512, 1024  # block bytes: 2 halves x tokens x 2 heads x 2 x 4
    half_r = 512
    # Chunk 5's V piece and chunk 6's K piece touch on both sides and merge.
    ranges = zip(
        rg.local_offset.tolist(), rg.remote_offset.tolist(), rg.length.tolist(), strict=True
    )
    assert list(ranges) == [
        (4 * lb, 4 * rb, 256),
        (4 * lb + 256, 4 * rb + half_r, 256),
        (5 * lb, 4 * rb + 256, 256),
        (5 * lb + 256, 4 * rb + half_r + 256, 512),
        (6 * lb + 256, 5 * rb + half_r, 256),
        (7 * lb, 5 * rb + 256, 256),
        (7 * lb + 256, 5 * rb + half_r + 256, 256),
    ]
    assert plan.local_kernel_blocks[0].tolist() == [4, 5, 6, 7]
    assert plan.remote_kernel_blocks[0].tolist() == [4, 5]
    assert plan.naive_descriptors == 8


def test_mla_chunks_merge_into_one_range_per_remote_block() -> None:
    """MLA has one column: consecutive chunks are contiguous on both sides and merge."""
    local = _side(Layout.MLA, 8, 32, 1)
    remote = _side(Layout.MLA, 32, 32, 1)
    plan = plan_pull(local, remote, [[0, 1]], [[3, 5]], prefix_caching=False)
    rg = plan.per_rank[0].ranges[0]
    block = 32 * LATENT * 4
    assert rg.remote_offset.tolist() == [3 * block, 5 * block]
    assert rg.length.tolist() == [block, block]


def test_sizes_that_do_not_tile_are_refused_naming_what_would_work() -> None:
    a = KVGroup("g", FA, logical_block_size=48, kernel_block_size=16)
    b = KVGroup("g", FA, logical_block_size=48, kernel_block_size=24)
    with pytest.raises(SpecError) as e:
        chunk_tokens(a, b)
    assert "16 (local) and 24 (remote)" in str(e.value)
    assert str([1, 2, 4, 8, 16, 48]) in str(e.value.fix)
    assert compatible_kernel_sizes(16, 48) == [1, 2, 4, 8, 16, 48]
    assert chunk_tokens(a, KVGroup("g", FA, 48, 48)) == 16


def test_merge_adjacent_keeps_bytes_and_merges_only_when_both_sides_touch() -> None:
    loc = np.array([0, 4, 8, 20], dtype=np.int64)
    rem = np.array([100, 104, 200, 204], dtype=np.int64)
    length = np.array([4, 4, 4, 4], dtype=np.int64)
    lo, ro, ln = merge_adjacent(loc, rem, length)
    assert lo.tolist() == [0, 8, 20] and ro.tolist() == [100, 200, 204]
    assert ln.tolist() == [8, 4, 4]


def _info(s: KVCacheSpec, *, prefix: bool) -> PeerInfo:
    return PeerInfo(spec=s, tp_rank=0, tp_size=1, prefix_caching=prefix, name="p")


@pytest.mark.parametrize(
    ("k_local", "k_remote", "lg_local", "lg_remote", "prefix", "topic"),
    [
        (16, 32, 64, 64, True, None),  # integral ratio, equal logical: compatible
        (32, 16, 64, 32, False, None),  # different logical sizes without prefix caching
        (16, 24, 48, 48, False, "kernel block size"),
        (16, 32, 64, 128, True, "logical block size"),
    ],
)
def test_handshake_accepts_integral_ratios_and_names_the_fix_otherwise(
    *, k_local: int, k_remote: int, lg_local: int, lg_remote: int, prefix: bool, topic: str | None
) -> None:
    local = _side(Layout.HND, k_local, lg_local, 2)
    remote = _side(Layout.HND, k_remote, lg_remote, 2)
    report = check_compatible(_info(local, prefix=prefix), _info(remote, prefix=prefix))
    topics = [m.what for m in report.mismatches]
    if topic is None:
        assert topics == []
    else:
        assert any(topic in t for t in topics), topics
        (m,) = [m for m in report.mismatches if topic in m.what]
        assert "docs/domain.md" in m.fix
