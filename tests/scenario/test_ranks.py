"""kvxferd.client.ranks against the planner: the ranks a scheduler pulls from are exactly the
ranks the decode daemon's plan reads from, every prefill rank is pulled by some decode rank,
and one status comes out of many (docs/tp.md)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.blocks import plan_pull
from kvxferd.blocks.tp import kv_head_range
from kvxferd.client import ErrorInfo, TransferState, TransferStatus, TransferStrategy
from kvxferd.client.ranks import (
    TPModel,
    combine,
    hold_readers,
    ranks_to_pull,
    read_ranks,
)
from kvxferd.layout.presets import dense, hybrid, mla
from kvxferd.layout.spec import KVCacheSpec

SIZES = (1, 2, 4, 8)


def _spec(model: TPModel, tp: int) -> KVCacheSpec:
    if model.mla:
        return mla(num_blocks=4, num_layers=2, latent_dim=8, block_size=4)
    heads = kv_head_range(0, tp, model.kv_heads)[1]
    if model.state:
        return hybrid(
            num_blocks=2, ppl=2, attention_layers=1, mamba_layers=1, num_kv_heads=heads, head_size=4
        )
    return dense(
        num_blocks=4, num_layers=2, num_kv_heads=heads, head_size=4, block_size=2, layout="HND"
    )


def _planned_ranks(model: TPModel, rank: int, local_tp: int, remote_tp: int) -> set[int]:
    local, remote = _spec(model, local_tp), _spec(model, remote_tp)
    ids = [[0, 1] for _ in local.groups]
    plan = plan_pull(
        local,
        remote,
        ids,
        ids,
        prefix_caching=False,
        local_tp=(rank, local_tp),
        remote_tp=(0, remote_tp),
    )
    return set(plan.per_rank)


models = st.one_of(
    st.sampled_from((1, 2, 4, 8)).map(lambda h: TPModel(kv_heads=h)),
    st.sampled_from((1, 2, 4, 8)).map(lambda h: TPModel(kv_heads=h, state=True)),
    st.just(TPModel(mla=True)),
)


@settings(max_examples=80, deadline=None)
@given(model=models, local_tp=st.sampled_from(SIZES), remote_tp=st.sampled_from(SIZES))
def test_read_ranks_are_the_planners(model: TPModel, local_tp: int, remote_tp: int) -> None:
    for rank in range(local_tp):
        assert set(read_ranks(model, rank, local_tp, remote_tp)) == _planned_ranks(
            model, rank, local_tp, remote_tp
        ), (model, rank, local_tp, remote_tp)


@settings(max_examples=200, deadline=None)
@given(model=models, local_tp=st.sampled_from(SIZES), remote_tp=st.sampled_from(SIZES))
def test_every_prefill_rank_is_pulled_and_reads_are_pulls(
    model: TPModel, local_tp: int, remote_tp: int
) -> None:
    readers = hold_readers(model, local_tp, remote_tp)
    assert set(readers) == set(range(remote_tp))
    assert all(n >= 1 for n in readers.values()), readers
    total = 0
    for rank in range(local_tp):
        pulls = ranks_to_pull(model, rank, local_tp, remote_tp)
        assert set(read_ranks(model, rank, local_tp, remote_tp)) <= set(pulls)
        total += len(pulls)
    assert sum(readers.values()) == total


def test_worked_examples() -> None:
    dense8 = TPModel(kv_heads=8)
    assert ranks_to_pull(dense8, 0, 1, 4) == (0, 1, 2, 3)
    assert [ranks_to_pull(dense8, r, 2, 1) for r in range(2)] == [(0,), (0,)]
    assert hold_readers(dense8, 2, 1) == {0: 2}
    latent = TPModel(mla=True)
    assert read_ranks(latent, 0, 1, 4) == (0,)
    assert ranks_to_pull(latent, 0, 1, 4) == (0, 1, 2, 3)  # 1-3 only release their holds
    assert [ranks_to_pull(latent, r, 2, 4) for r in range(2)] == [(0, 2), (1, 3)]
    # 2 KV heads replicated over prefill TP 4 (copies 0,1 hold head 0; 2,3 head 1): the decode
    # rank reads each head once, from copies 0 and 2, and only releases 1 and 3.
    hyb = TPModel(kv_heads=2, state=True)
    assert read_ranks(hyb, 0, 1, 4) == (0, 2)
    assert ranks_to_pull(hyb, 0, 1, 4) == (0, 1, 2, 3)


def test_bad_inputs_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="describes no KV cache"):
        TPModel()
    with pytest.raises(ValueError, match="do not divide"):
        read_ranks(TPModel(kv_heads=8), 0, 2, 3)
    with pytest.raises(ValueError, match="do not split"):
        read_ranks(TPModel(kv_heads=6), 0, 1, 4)
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, 2\)"):
        read_ranks(TPModel(kv_heads=8), 2, 2, 1)


def _status(
    state: TransferState, invalid: tuple[tuple[int, ...], ...] = (), msg: str = ""
) -> TransferStatus:
    return TransferStatus(
        transfer_id="t",
        request_id="r",
        peer_address="p",
        state=state,
        nbytes=10,
        strategy=TransferStrategy.DIRECT,
        strategy_reason="",
        error=ErrorInfo("LEASE_REFUSED", msg) if msg else None,
        invalid_local_block_ids=invalid,
        descriptors_before_coalescing=0,
        descriptors_after_coalescing=0,
        created_unix_ns=0,
        started_unix_ns=0,
        finished_unix_ns=0,
        deadline_unix_ns=0,
        revision=1,
    )


def test_combine_done_only_when_every_rank_is_done() -> None:
    done = combine({0: _status(TransferState.DONE), 1: _status(TransferState.DONE)})
    assert done.state is TransferState.DONE and done.error is None and done.nbytes == 20
    mixed = combine(
        {
            0: _status(TransferState.DONE),
            1: _status(TransferState.CANCELLED, ((4, 5), (1,))),
            2: _status(TransferState.FAILED, ((5, 6),), msg="lease lapsed"),
        }
    )
    assert mixed.state is TransferState.CANCELLED and mixed.failed_rank == 1
    assert mixed.invalid_local_block_ids == ((4, 5, 6), (1,))
    refused = combine({0: _status(TransferState.CANCELLED)}, (1, ErrorInfo("X", "no HND")))
    assert refused.state is TransferState.FAILED and refused.failed_rank == 1
    assert refused.error is not None and refused.error.message == "no HND"
