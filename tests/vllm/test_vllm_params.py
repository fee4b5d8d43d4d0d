"""The connector's pure parts: tickets in ``kv_transfer_params``, which blocks a finished
prefill holds, how a decode request's blocks pair with the held ones (prefix-cache hits move
only the missing blocks), the shared-memory KV allocation, and that kvxferd imports without
vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvxferd.errors import InvalidRequest, SpecError
from kvxferd.layout.spec import GroupKind
from kvxferd.v1 import scheduler_pb2
from kvxferd.vllm.memory import SharedKvAllocation
from kvxferd.vllm.params import (
    Decline,
    LocalBlock,
    Ticket,
    blocks_to_hold,
    check_prompt,
    plan_pull,
    pull_lists,
    ticket_from_params,
    unpulled_decline,
)
from kvxferd.wire.codec import group_ids_to_proto

FA, SWA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA


def _ticket(ids: list[list[int]], starts: list[int] | None = None) -> Ticket:
    return Ticket(
        "127.0.0.1:5000",
        "req-1",
        tuple(tuple(g) for g in ids),
        tuple(starts or [0] * len(ids)),
        123,
        100,
    )


def test_ticket_round_trips_through_kv_transfer_params() -> None:
    t = _ticket([[4, 5, 6], [9]], [0, 2])
    params = t.to_params()
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert ticket_from_params(params) == t
    assert ticket_from_params({"do_remote_decode": True}) is None
    assert ticket_from_params(None) is None


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("peer_address", "nowhere", "host:port"),
        ("request_id", "", "non-empty"),
        ("remote_block_ids", [[1, "2"]], "integer"),
        ("remote_block_ids", "1,2", "list of lists"),
        ("remote_starts", [0, 0], "one position per group"),
    ],
)
def test_malformed_ticket_names_the_field(field: str, value: object, match: str) -> None:
    params = _ticket([[1, 2]]).to_params()
    params["kvxferd"][field] = value
    with pytest.raises(InvalidRequest, match=match) as ei:
        ticket_from_params(params)
    assert "docs/vllm.md" in str(ei.value)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("remote_block_ids", [[2**63, 8]], r"a block ID must be in \[0, 2\*\*63\)"),
        ("remote_block_ids", [[-1, 8]], r"a block ID must be in \[0, 2\*\*63\)"),
        ("remote_starts", [-3], r"a start position must be in \[0, 2\*\*63\)"),
        ("num_tokens", 2**64, r"num_tokens must be in \[0, 2\*\*63\)"),
        ("expires_unix_ns", -(2**70), r"expires_unix_ns must be in \[0, 2\*\*63\)"),
        ("request_id", "\ud800", "non-empty UTF-8 string"),
        ("peer_address", "h\udfff:1", "host:port"),
        ("peer_addresses", ["127.0.0.1:5000", "h\ud800:1"], "one 'host:port' per"),
    ],
)
def test_a_ticket_protobuf_cannot_carry_is_refused_when_parsed(
    field: str, value: object, match: str
) -> None:
    """Before, a block ID >= 2**63 (or negative) and a lone surrogate (valid JSON "\\ud800")
    passed ticket_from_params and raised in the worker when StartPull/DeclinePull was built,
    inside vLLM's execute_model on every rank. Now they are malformed tickets: refused at parse
    time (the connector logs it and computes the request locally)."""
    params = _ticket([[1, 2]]).to_params()
    params["kvxferd"][field] = value
    params = json.loads(json.dumps(params))  # what vLLM's API server hands the connector
    with pytest.raises(InvalidRequest, match=match) as ei:
        ticket_from_params(params)
    assert "docs/vllm.md" in str(ei.value)
    assert unpulled_decline(params, planned=False, now_ns=0, decode_tp=1) is None


def test_the_largest_accepted_ticket_builds_its_protobuf_requests() -> None:
    big = 2**63 - 1
    params = json.loads(json.dumps(_ticket([[big, 0]], [big]).to_params()))
    t = ticket_from_params(params)
    assert t is not None and t.remote_block_ids == ((big, 0),)
    scheduler_pb2.StartPullRequest(
        request_id=t.request_id,
        peer_address=t.peer_address,
        remote_block_ids=group_ids_to_proto([list(g) for g in t.remote_block_ids]),
    ).SerializeToString()


def test_a_ticket_held_for_another_prompt_length_is_refused() -> None:
    # Before, a decode request carrying another request's ticket (a proxy mix-up) pulled that
    # prompt's KV cache, or, shorter, left positions no held block fills (load errors).
    t = _ticket([[1, 2]])  # num_tokens 100
    check_prompt(t, 100)
    with pytest.raises(InvalidRequest, match="holds a prompt of 100 tokens, this request's has 99"):
        check_prompt(t, 99)
    with pytest.raises(InvalidRequest, match="num_tokens"):
        check_prompt(t, 101)


def _tp2_ticket(ids: list[list[int]]) -> Ticket:
    addrs = ("10.0.0.5:5000", "10.0.0.5:5001")
    return Ticket(addrs[0], "req-1", tuple(tuple(g) for g in ids), (0,) * len(ids), 1, 64, addrs)


def test_a_tp2_ticket_names_every_prefill_ranks_daemon_and_round_trips() -> None:
    t = _tp2_ticket([[4, 5]])
    params = t.to_params()
    assert params["kvxferd"]["peer_addresses"] == ["10.0.0.5:5000", "10.0.0.5:5001"]
    assert params["kvxferd"]["peer_address"] == "10.0.0.5:5000"  # rank 0, as for TP 1
    assert ticket_from_params(params) == t and t.tp_size == 2
    one = _ticket([[4]])
    assert "peer_addresses" not in one.to_params()["kvxferd"]
    assert one.tp_size == 1 and one.rank_addresses == ("127.0.0.1:5000",)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([], "one 'host:port' per prefill TP rank"),
        (["10.0.0.5:5000", "nowhere"], "one 'host:port' per prefill TP rank"),
        ("10.0.0.5:5000", "one 'host:port' per prefill TP rank"),
        (["10.0.0.9:5000", "10.0.0.5:5001"], "must equal peer_address"),
    ],
)
def test_malformed_peer_addresses_are_refused(value: object, match: str) -> None:
    params = _tp2_ticket([[1]]).to_params()
    params["kvxferd"]["peer_addresses"] = value
    with pytest.raises(InvalidRequest, match=match):
        ticket_from_params(params)


def test_a_decode_request_that_ended_before_its_pull_declines_every_ranks_hold() -> None:
    """The connector's request_finished (docs/vllm.md): a decode request with a live ticket
    that ended before its pull was planned declines every prefill rank's hold; one that was
    planned (its pull's end releases the hold), carries no ticket, a malformed or an expired
    one owes nothing."""
    params = _tp2_ticket([[4, 5]]).to_params()  # expires_unix_ns = 1
    live = dict(params, kvxferd=dict(params["kvxferd"], expires_unix_ns=2_000))
    d = unpulled_decline(live, planned=False, now_ns=1_000, decode_tp=2)
    assert d == Decline("req-1", ("10.0.0.5:5000", "10.0.0.5:5001"), 2)
    assert d is not None and [d.peers_for(r) for r in range(2)] == [(a,) for a in d.peer_addresses]
    assert unpulled_decline(live, planned=True, now_ns=1_000, decode_tp=2) is None
    assert unpulled_decline(live, planned=False, now_ns=2_000, decode_tp=2) is None  # expired
    assert unpulled_decline(None, planned=False, now_ns=0, decode_tp=2) is None
    no_ticket = {"do_remote_decode": True}
    assert unpulled_decline(no_ticket, planned=False, now_ns=0, decode_tp=2) is None
    bad = dict(live, kvxferd=dict(live["kvxferd"], peer_address="nowhere"))
    assert unpulled_decline(bad, planned=False, now_ns=0, decode_tp=2) is None


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (4, 2), (2, 4), (3, 2), (1, 3)])
def test_the_decode_ranks_decline_every_prefill_ranks_hold_once(
    prefill_tp: int, decode_tp: int
) -> None:
    """Whatever the two TP sizes (a refused plan of different sizes is declined too), every
    prefill rank's hold is declined by exactly one decode rank."""
    addrs = tuple(f"10.0.0.5:{5000 + r}" for r in range(prefill_tp))
    d = Decline("req-1", addrs, decode_tp)
    declined = [a for r in range(decode_tp) for a in d.peers_for(r)]
    assert sorted(declined) == sorted(addrs)


def test_each_decode_rank_pulls_from_the_prefill_rank_of_its_index() -> None:
    job, err = plan_pull("r", _tp2_ticket([[4, 5]]), [_table([40, 41], 0)], [FA], 64, tp_size=2)
    assert err is None
    assert (job.peer_for(0), job.peer_for(1)) == ("10.0.0.5:5000", "10.0.0.5:5001")
    assert job.remote == ((4, 5),) and job.local == ((40, 41),)  # one block table for all ranks


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 4)])
def test_different_tp_sizes_are_refused_and_every_needed_block_is_a_load_error(
    prefill_tp: int, decode_tp: int
) -> None:
    addrs = tuple(f"10.0.0.5:{5000 + r}" for r in range(prefill_tp))
    ticket = Ticket(addrs[0], "req-1", ((4, 5),), (0,), 1, 64, addrs if prefill_tp > 1 else ())
    job, err = plan_pull("r", ticket, [_table([40, 41], 1)], [FA], 32, tp_size=decode_tp)
    assert err is not None
    text = str(err)
    assert f"tensor_parallel_size {prefill_tp}, this decode engine {decode_tp}" in text
    assert "same tensor_parallel_size" in text and "docs/vllm.md" in text
    assert job.remote == () and job.unfillable == (41,)  # recomputed (or failed) by vLLM
    assert job.peer_for(0) == ""  # no rank pulls


def test_blocks_to_hold_clip_to_the_prompt_and_drop_null_placeholders() -> None:
    # 70 tokens in 32-token blocks: 3 blocks; a 4th (a decode slot) is not held. The SWA
    # group's first block fell out of the window (null block 0). Mamba keeps its last state.
    held = blocks_to_hold(
        [FA, SWA, MAMBA], [[7, 8, 9, 10], [0, 12, 13], [0, 21, 22]], 70, [32, 32, 32]
    )
    assert held.ids == ((7, 8, 9), (12, 13), (22,))
    assert held.starts == (0, 1, 0)


def _table(ids: list[int], cached: int) -> list[LocalBlock]:
    return [LocalBlock(b, i >= cached and b != 0) for i, b in enumerate(ids)]


def test_full_pull_pairs_every_position() -> None:
    lists = pull_lists([FA], _ticket([[4, 5, 6, 7]]), [_table([40, 41, 42, 43], 0)])
    assert lists.remote == ((4, 5, 6, 7),) and lists.local == ((40, 41, 42, 43),)
    assert lists.unfillable == () and lists.num_blocks == 4


def test_prefix_hit_moves_only_the_missing_blocks_at_their_positions() -> None:
    # decode already holds positions 0-7 (a cached 256-token prefix); positions 8, 9 move
    remote = list(range(100, 110))
    local = list(range(200, 210))
    lists = pull_lists([FA], _ticket([remote]), [_table(local, 8)])
    assert lists.remote == ((108, 109),) and lists.local == ((208, 209),)


def test_sliding_window_start_offsets_positions_and_gaps_are_unfillable() -> None:
    # remote holds positions 2.. (0, 1 out of its window); local needs positions 1..3
    lists = pull_lists([SWA], _ticket([[12, 13]], [2]), [_table([0, 31, 32, 33], 1)])
    assert lists.remote == ((12, 13),) and lists.local == ((32, 33),)
    assert lists.unfillable == (31,)  # position 1: nothing held there


def test_mamba_pairs_the_latest_state() -> None:
    lists = pull_lists([FA, MAMBA], _ticket([[1, 2], [9]]), [_table([5, 6], 0), _table([0, 7], 0)])
    assert lists.remote == ((1, 2), (9,)) and lists.local == ((5, 6), (7,))


def test_full_local_hit_pulls_nothing() -> None:
    lists = pull_lists([FA], _ticket([[1, 2]]), [_table([5, 6], 2)])
    assert lists.remote == ((),) and lists.num_blocks == 0


def test_group_count_mismatch_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="2 KV cache groups, this engine 1"):
        pull_lists([FA], _ticket([[1], [2]]), [_table([5], 0)])


def test_shared_kv_allocation_serves_vllms_buffer_from_shared_memory() -> None:
    alloc = SharedKvAllocation(prefix="kvxferd-vllm-test")
    with alloc:
        other = torch.zeros(4, dtype=torch.float32)  # not the KV buffer: untouched
        buf = torch.zeros(8192, dtype=torch.int8, device="cpu")
        again = torch.zeros(64, dtype=torch.int8)  # only the first one is shared
    seg, got = alloc.require()
    assert got is buf and buf.dtype is torch.int8 and int(buf.sum()) == 0
    assert other.dtype is torch.float32 and again.numel() == 64
    path = Path("/dev/shm") / seg.name.lstrip("/")
    assert path.stat().st_size == 8192
    buf[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.int8)
    assert seg.tensor(0, 4).tolist() == [1, 2, 3, 4]  # the same memory
    alloc.unlink()
    assert not path.exists()
    buf[4] = 5  # still mapped after the name is gone


def test_require_explains_when_vllm_allocated_elsewhere() -> None:
    with pytest.raises(SpecError, match="get_mem_pool_context"):
        SharedKvAllocation().require()


def test_kvxferd_imports_without_vllm() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import kvxferd.vllm, kvxferd.vllm.spec, kvxferd.vllm.params, kvxferd.vllm.daemon\n"
        "import kvxferd.vllm.memory, kvxferd.vllm.tiny_model, kvxferd.commands.demo_vllm\n"
        "import kvxferd.vllm.worker, kvxferd.vllm.holds, kvxferd.vllm.host\n"
        "import kvxferd.cli\n"
        "try:\n"
        "    import kvxferd.vllm.connector\n"
        "except ImportError:\n"
        "    print('connector needs vllm')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "connector needs vllm"
