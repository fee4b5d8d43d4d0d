"""The translation at a TP position, without vLLM: vLLM's spec of a TP worker already holds that
rank's KV heads (an MLA latent is whole on every rank), so the regions do not depend on the
rank; the TP size goes into the fingerprint's page format, the position rides with the spec to
the Attach, and kvxferd's planner makes decode rank ``d`` read prefill rank ``d``: whole blocks
for dense heads, and for MLA the latent, which any prefill rank could serve, from the rank of
the same index, so every prefill rank's hold is released by its one reader."""

from __future__ import annotations

import pytest
import torch

from kvxferd.blocks import plan_pull
from kvxferd.errors import SpecError
from kvxferd.layout.spec import Layout
from kvxferd.vllm.spec import translate
from kvxferd.vllm.tensors import describe
from tests.vllm.test_vllm_spec import (
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    _layer_compact,
    dense,
)


def mla(num_blocks: int = 8) -> KVCacheConfig:
    spec = MLAAttentionSpec(64, 1, 576, torch.bfloat16, head_size_v=0)
    layers = [f"mla.{i}" for i in range(3)]
    _, t = _layer_compact(spec, layers, num_blocks)
    return KVCacheConfig(num_blocks, [t], [KVCacheGroupSpec(layers, spec)], "LBHNC")


def test_dense_ranks_hold_their_own_heads_and_carry_their_position() -> None:
    # 4 KV heads over TP 2: vLLM's per-worker spec says 2 heads on each rank.
    ranks = [
        translate(dense(heads=2), model="m", backend="CPU_ATTN", tp_rank=r, tp_size=2)
        for r in range(2)
    ]
    assert [(t.tp_rank, t.tp_size) for t in ranks] == [(0, 2), (1, 2)]
    assert ranks[0].spec == ranks[1].spec  # the same geometry and fingerprint on every rank
    assert ranks[0].spec.model == "m [vllm-kv layout=LBHNC backend=CPU_ATTN tp=2]"
    assert {r.shape for r in ranks[0].spec.regions} == {(256, 2, 32, 2, 32)}
    one = translate(dense(heads=2), model="m", backend="CPU_ATTN")
    assert (one.tp_rank, one.tp_size) == (0, 1) and one.spec.model != ranks[0].spec.model


def test_mla_is_the_whole_latent_on_every_rank() -> None:
    t = translate(mla(), model="ds", tp_rank=1, tp_size=2)
    assert (t.tp_rank, t.tp_size) == (1, 2)
    assert {(r.layout, r.shape) for r in t.spec.regions} == {(Layout.MLA, (8, 64, 576))}
    assert t.spec.regions == translate(mla(), model="ds").spec.regions  # TP does not slice it
    assert t.spec.model.endswith("tp=2]")


@pytest.mark.parametrize("cfg", [dense(num_blocks=16, heads=2), mla()], ids=["dense", "mla"])
def test_decode_rank_d_reads_whole_blocks_from_prefill_rank_d_only(cfg: KVCacheConfig) -> None:
    for d in range(2):
        spec = translate(cfg, model="m", tp_rank=d, tp_size=2).spec
        plan = plan_pull(
            spec,
            spec,
            [[3, 4, 5]],
            [[1, 2, 6]],
            prefix_caching=False,
            local_tp=(d, 2),
            remote_tp=(0, 2),
        )
        assert set(plan.per_rank) == {d}  # a pull from the other rank would read nothing
        part = plan.per_rank[d]
        block = spec.regions[0].block_len
        assert all(r.nbytes == 3 * block for r in part.ranges)  # whole blocks


@pytest.mark.parametrize(("rank", "size"), [(2, 2), (-1, 2), (0, 0)])
def test_a_tp_position_outside_the_group_is_refused(rank: int, size: int) -> None:
    with pytest.raises(SpecError, match=f"TP rank {rank} is not in") as err:
        translate(dense(), model="m", tp_rank=rank, tp_size=size)
    assert "docs/vllm.md" in str(err.value)
    views = {"model.layers.0.self_attn.attn": torch.zeros(1)}
    with pytest.raises(SpecError, match=f"TP rank {rank} is not in"):
        describe(dense(), views, model="m", tp_rank=rank, tp_size=size)


def test_the_tensor_description_carries_the_position_too() -> None:
    cfg = dense(num_blocks=4, heads=2)
    t = translate(cfg, model="m")
    raw = torch.zeros(t.buffer_size, dtype=torch.int8)
    views = {}
    for p, r in zip(t.placements, t.spec.regions, strict=True):
        # vLLM's [B, H, N, C] layer view (LBHNC), C = K then V of one head, in bf16
        shape = (r.num_blocks, 2, 32, 64)
        views[p.region] = raw[p.offset : p.offset + r.nbytes].view(torch.bfloat16).view(shape)
    d = describe(cfg, views, model="m", layout="LBHNC", tp_rank=1, tp_size=2)
    assert (d.tp_rank, d.tp_size) == (1, 2)
    assert d.page_format.endswith("tp=2")
