"""Multi-rank pulls for a scheduler: which prefill ranks a decode rank pulls, and one status.

Under heterogeneous tensor parallelism (docs/tp.md) a decode rank's KV heads live on one or
several prefill ranks. A ``StartPull`` names one prefill daemon, and the decode daemon reads
from it exactly the part of the request that this daemon's TP rank holds for the decode rank
(nothing, when it holds none: the pull then only releases its share of the lease). The
scheduler therefore:

1. holds the request on every prefill rank with ``expected_readers = hold_readers(...)[rank]``;
2. for each decode rank, starts one pull per rank of :func:`ranks_to_pull` with that rank's
   ``HoldResponse`` (:func:`pull_from_ranks` does this and waits);
3. treats the request as transferred to a decode rank only when every one of its pulls is
   DONE (:func:`combine`).

The rank arithmetic here repeats the planner's rules (``kvxferd/blocks/tp.py``) in plain
Python so that this package keeps needing neither NumPy nor torch; a test checks it against
the planner for every TP pair and model kind.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvxferd.client import (
    AsyncSchedulerClient,
    ErrorInfo,
    KvxferdRpcError,
    SchedulerClient,
    TransferState,
    TransferStatus,
)


@dataclass(frozen=True)
class TPModel:
    """What decides where a decode rank's blocks come from.

    ``kv_heads``: the model's total KV heads of its attention layers (before TP slicing;
    0 when it has no attention KV cache, e.g. a pure MLA model). ``mla``: it has MLA latent
    groups (identical on every rank). ``state``: it has Mamba/SSM state groups (copied whole).
    """

    kv_heads: int = 0
    mla: bool = False
    state: bool = False

    def __post_init__(self) -> None:
        if self.kv_heads < 0 or not (self.kv_heads or self.mla or self.state):
            raise ValueError(
                f"TPModel(kv_heads={self.kv_heads}, mla={self.mla}, state={self.state})"
                " describes no KV cache: give the attention KV head count (> 0), mla=True"
                " or state=True"
            )


def _check_tp(rank: int, size: int, what: str) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"{what}: rank {rank} is not in [0, {size}) (TP size must be >= 1)")


def _check_sizes(local_tp: int, remote_tp: int) -> None:
    _check_tp(0, local_tp, "decode TP")
    _check_tp(0, remote_tp, "prefill TP")
    big, small = max(local_tp, remote_tp), min(local_tp, remote_tp)
    if big % small:
        raise ValueError(
            f"TP sizes do not divide: decode {local_tp}, prefill {remote_tp}; pick sizes where"
            " one is a multiple of the other"
        )


def _per_rank(total: int, tp: int) -> int:
    if tp <= total:
        if total % tp:
            raise ValueError(f"{total} KV heads do not split over TP {tp}")
        return total // tp
    if tp % total:
        raise ValueError(f"TP {tp} is not a multiple of the {total} KV heads it replicates")
    return 1


def _effective_heads(kv_heads: int, local_tp: int, remote_tp: int) -> int:
    """The head total the decode daemon infers from both sides' per-rank counts (it does not
    know the model's): ``min`` of heads-per-rank x TP over the two sides."""
    return min(_per_rank(kv_heads, local_tp) * local_tp, _per_rank(kv_heads, remote_tp) * remote_tp)


def read_ranks(model: TPModel, local_rank: int, local_tp: int, remote_tp: int) -> tuple[int, ...]:
    """The prefill ranks whose blocks decode rank ``local_rank`` reads bytes from (sorted).

    Attention: the ranks holding its heads, each head once (a replicated head is read from
    copy ``head * m + local_rank % m``); MLA: rank ``local_rank % remote_tp``; state: rank
    ``local_rank * remote_tp // local_tp``.
    """
    _check_sizes(local_tp, remote_tp)
    _check_tp(local_rank, local_tp, "decode rank")
    out: set[int] = set()
    if model.kv_heads:
        total = _effective_heads(model.kv_heads, local_tp, remote_tp)
        if local_tp <= total:
            count = total // local_tp
            first = local_rank * count
        else:
            first, count = local_rank // (local_tp // total), 1
        if remote_tp <= total:
            per = total // remote_tp
            out.update(range(first // per, (first + count - 1) // per + 1))
        else:
            copies = remote_tp // total
            out.update(h * copies + local_rank % copies for h in range(first, first + count))
    if model.mla:
        out.add(local_rank % remote_tp)
    if model.state:
        out.add(local_rank * remote_tp // local_tp)
    return tuple(sorted(out))


def ranks_to_pull(
    model: TPModel, local_rank: int, local_tp: int, remote_tp: int
) -> tuple[int, ...]:
    """The prefill ranks decode rank ``local_rank`` starts a pull from (sorted).

    Its :func:`read_ranks`, plus every prefill rank that no decode rank reads (MLA's other
    ranks, unread copies of replicated heads) with ``rank % local_tp == local_rank``: the pull
    from such a rank reads nothing and ends DONE once it has released its share of that
    rank's lease, so every prefill rank's hold is released by some decode rank.
    """
    mine = set(read_ranks(model, local_rank, local_tp, remote_tp))
    read_by_any: set[int] = set()
    for rank in range(local_tp):
        read_by_any.update(read_ranks(model, rank, local_tp, remote_tp))
    unread = set(range(remote_tp)) - read_by_any
    mine.update(r for r in unread if r % local_tp == local_rank)
    return tuple(sorted(mine))


def hold_readers(model: TPModel, local_tp: int, remote_tp: int) -> dict[int, int]:
    """Per prefill rank, how many decode ranks pull from it: its Hold's ``expected_readers``."""
    out = dict.fromkeys(range(remote_tp), 0)
    for rank in range(local_tp):
        for r in ranks_to_pull(model, rank, local_tp, remote_tp):
            out[r] += 1
    return out


@dataclass(frozen=True)
class RankHold:
    """What one prefill rank's ``Hold`` returned (the fields a StartPull needs)."""

    peer_address: str
    request_id: str
    remote_block_ids: Sequence[Sequence[int]]


@dataclass(frozen=True)
class RankedPull:
    """One decode rank's pulls of one request from several prefill ranks, as one result.

    ``state``: DONE only when every rank's pull is DONE; otherwise the state of the first
    failure (lowest prefill rank), with its ``error`` and ``failed_rank``.
    ``invalid_local_block_ids``: per group, the sorted union of the local kernel blocks every
    pull listed as possibly written (they must not be used). ``statuses``: per prefill rank,
    the terminal status of its pull (missing for a rank whose StartPull was refused).
    """

    state: TransferState
    error: ErrorInfo | None
    failed_rank: int | None
    invalid_local_block_ids: tuple[tuple[int, ...], ...]
    statuses: Mapping[int, TransferStatus]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.statuses.values())


def combine(
    statuses: Mapping[int, TransferStatus],
    refused: tuple[int, ErrorInfo] | None = None,
) -> RankedPull:
    """One result from per-rank terminal statuses (and a StartPull refusal, if any)."""
    groups: list[set[int]] = []
    for st in statuses.values():
        for g, ids in enumerate(st.invalid_local_block_ids):
            while len(groups) <= g:
                groups.append(set())
            groups[g].update(ids)
    invalid = tuple(tuple(sorted(g)) for g in groups)
    if refused is not None:
        return RankedPull(TransferState.FAILED, refused[1], refused[0], invalid, dict(statuses))
    for rank in sorted(statuses):
        st = statuses[rank]
        if st.state is not TransferState.DONE:
            error = st.error or ErrorInfo(
                "UNSPECIFIED", f"the pull from prefill rank {rank} ended {st.state.name}"
            )
            return RankedPull(st.state, error, rank, invalid, dict(statuses))
    return RankedPull(TransferState.DONE, None, None, invalid, dict(statuses))


def _needed(
    holds: Mapping[int, RankHold], model: TPModel, local_rank: int, local_tp: int, remote_tp: int
) -> tuple[int, ...]:
    need = ranks_to_pull(model, local_rank, local_tp, remote_tp)
    missing = [r for r in need if r not in holds]
    if missing:
        raise ValueError(
            f"decode rank {local_rank}/{local_tp} pulls from prefill ranks {list(need)} of"
            f" {remote_tp}, but there is no Hold for ranks {missing}; hold the request on every"
            " prefill rank (expected_readers from hold_readers()) and pass each HoldResponse"
        )
    return need


def _start_args(
    h: RankHold, local_block_ids: Sequence[Sequence[int]], tid: str, deadline_ms: int
) -> dict[str, Any]:
    return {
        "request_id": h.request_id,
        "peer_address": h.peer_address,
        "remote_block_ids": h.remote_block_ids,
        "local_block_ids": local_block_ids,
        "transfer_id": tid,
        "deadline_ms": deadline_ms,
    }


def _refusal(exc: KvxferdRpcError) -> ErrorInfo:
    return exc.error or ErrorInfo(exc.code.name, exc.details)


def pull_from_ranks(
    client: SchedulerClient,
    holds: Mapping[int, RankHold],
    local_block_ids: Sequence[Sequence[int]],
    *,
    model: TPModel,
    local_rank: int,
    local_tp: int,
    remote_tp: int,
    transfer_id: str = "",
    deadline_ms: int = 0,
    timeout_s: float = 60.0,
) -> RankedPull:
    """Pull one request into decode rank ``local_rank`` (``client``) from every prefill rank
    it needs, wait for every pull, and return one :class:`RankedPull`.

    ``holds``: prefill rank -> its Hold; it must cover :func:`ranks_to_pull` (a missing rank
    raises ``ValueError`` before anything starts). Pull ``r`` gets transfer ID
    ``<transfer_id>.r<r>`` (a retry with the same ``transfer_id`` finds the same pulls).
    Every rank's pull is started even when another's StartPull is refused (an incompatible
    prefill rank, say), so that every hold that can be read is read and released; nothing is
    cancelled, so a failed rank can be pulled again alone (docs/tp.md §3). Raises
    ``TimeoutError`` when the pulls are not all terminal within ``timeout_s``.
    """
    need = _needed(holds, model, local_rank, local_tp, remote_tp)
    base = transfer_id or uuid.uuid4().hex
    started: dict[int, str] = {}
    refused: tuple[int, ErrorInfo] | None = None
    for r in need:
        try:
            got = client.start_pull(
                **_start_args(holds[r], local_block_ids, f"{base}.r{r}", deadline_ms)
            )
        except KvxferdRpcError as exc:
            refused = refused or (r, _refusal(exc))
            continue
        started[r] = got.status.transfer_id
    deadline = time.monotonic() + timeout_s
    statuses = {
        r: client.wait(tid, timeout_s=max(0.001, deadline - time.monotonic()))
        for r, tid in started.items()
    }
    return combine(statuses, refused)


async def pull_from_ranks_async(
    client: AsyncSchedulerClient,
    holds: Mapping[int, RankHold],
    local_block_ids: Sequence[Sequence[int]],
    *,
    model: TPModel,
    local_rank: int,
    local_tp: int,
    remote_tp: int,
    transfer_id: str = "",
    deadline_ms: int = 0,
    timeout_s: float = 60.0,
) -> RankedPull:
    """:func:`pull_from_ranks` for asyncio: the StartPulls go out together, and the pulls are
    awaited together."""
    need = _needed(holds, model, local_rank, local_tp, remote_tp)
    base = transfer_id or uuid.uuid4().hex
    answers = await asyncio.gather(
        *(
            client.start_pull(**_start_args(holds[r], local_block_ids, f"{base}.r{r}", deadline_ms))
            for r in need
        ),
        return_exceptions=True,
    )
    started: dict[int, str] = {}
    refused: tuple[int, ErrorInfo] | None = None
    for r, got in zip(need, answers, strict=True):
        if isinstance(got, KvxferdRpcError):
            refused = refused or (r, _refusal(got))
        elif isinstance(got, BaseException):
            raise got
        else:
            started[r] = got.status.transfer_id
    done = await asyncio.gather(*(client.wait(tid, timeout_s) for tid in started.values()))
    return combine(dict(zip(started, done, strict=True)), refused)
