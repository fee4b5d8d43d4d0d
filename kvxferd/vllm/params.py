"""The ``kv_transfer_params`` a disaggregated proxy forwards, and how a pull's block lists are
chosen from them (pure: no vLLM, no gRPC).

The prefill engine's connector holds a finished prompt on its daemon and returns the hold's
answer in the request's ``kv_transfer_params`` (vLLM hands them to the client); the proxy
passes them unchanged to the decode engine, whose connector pulls from them:

.. code-block:: json

    {"do_remote_prefill": true, "do_remote_decode": false,
     "kvxferd": {"peer_address": "10.0.0.5:50051", "request_id": "cmpl-1-0",
                 "remote_block_ids": [[7, 8, 9]], "remote_starts": [0],
                 "expires_unix_ns": 1795469101363703000, "num_tokens": 40}}

``remote_block_ids`` has one list per kvxferd group (vLLM's transfer groups, in order); each
list holds the prompt's blocks from position ``remote_starts[g]`` on (a sliding-window group
drops the out-of-window blocks before it). docs/vllm.md describes the fields.

With tensor parallelism (TP ``P`` > 1) the prompt is held on every prefill rank's daemon and
the ticket adds ``"peer_addresses"``: the ``P`` daemons' peer addresses in rank order
(``peer_address`` repeats rank 0's). The TP ranks of one engine share one block table, so the
request ID and block IDs are the same on every rank. Decode rank ``d`` pulls from
``peer_addresses[d]``: the decode engine must run the same TP size (:func:`plan_pull` refuses
another, with the reason).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvxferd.errors import InvalidRequest, KvxferdError
from kvxferd.layout.spec import GroupKind

KEY = "kvxferd"
DOC = "docs/vllm.md"
NULL_BLOCK = 0  # vLLM's null block: a placeholder, never holds data


@dataclass(frozen=True)
class Ticket:
    """A held prompt on the prefill side's daemon: what the decode side pulls."""

    peer_address: str
    request_id: str
    remote_block_ids: tuple[tuple[int, ...], ...]
    remote_starts: tuple[int, ...]
    expires_unix_ns: int
    num_tokens: int
    peer_addresses: tuple[str, ...] = ()  # TP > 1: every prefill rank's daemon, rank order

    @property
    def rank_addresses(self) -> tuple[str, ...]:
        """The prefill daemon of each TP rank (one for TP 1)."""
        return self.peer_addresses or (self.peer_address,)

    @property
    def tp_size(self) -> int:
        """The prefill engine's TP size."""
        return len(self.rank_addresses)

    def to_params(self) -> dict[str, Any]:
        """The request's ``kv_transfer_params`` for the decode side."""
        body: dict[str, Any] = {
            "peer_address": self.peer_address,
            "request_id": self.request_id,
            "remote_block_ids": [list(g) for g in self.remote_block_ids],
            "remote_starts": list(self.remote_starts),
            "expires_unix_ns": self.expires_unix_ns,
            "num_tokens": self.num_tokens,
        }
        if self.tp_size > 1:
            body["peer_addresses"] = list(self.rank_addresses)
        return {"do_remote_prefill": True, "do_remote_decode": False, KEY: body}


def _bad(what: str, got: Any) -> InvalidRequest:
    return InvalidRequest(
        f"kv_transfer_params[{KEY!r}]: {what} (got {got!r})",
        field=f"kv_transfer_params.{KEY}",
        fix="pass the prefill engine's kv_transfer_params to the decode engine unchanged"
        f" (see {DOC}, 'The proxy')",
    )


INT64_MAX = 2**63 - 1  # the ticket's integers travel as protobuf int64 (block IDs) or compare with
# int64 clocks: anything larger, or negative, is not a ticket the prefill side wrote


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"{what} must be an integer", v)
    if not 0 <= v <= INT64_MAX:
        raise _bad(f"{what} must be in [0, 2**63)", v)
    return v


def _utf8(v: Any) -> bool:
    """A string that protobuf can encode (no lone surrogates, which JSON lets through)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def ticket_from_params(params: Mapping[str, Any] | None) -> Ticket | None:
    """The ticket in a decode request's ``kv_transfer_params``; None when there is none (not a
    remote prefill). Raises InvalidRequest naming the bad field when one is malformed."""
    if not params or not params.get("do_remote_prefill") or KEY not in params:
        return None
    raw = params[KEY]
    if not isinstance(raw, Mapping):
        raise _bad("must be an object", raw)
    addr, rid = raw.get("peer_address"), raw.get("request_id")
    if not isinstance(addr, str) or ":" not in addr or not _utf8(addr):
        raise _bad("peer_address must be 'host:port'", addr)
    if not isinstance(rid, str) or not rid or not _utf8(rid):
        raise _bad("request_id must be a non-empty UTF-8 string", rid)
    groups = raw.get("remote_block_ids")
    if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
        raise _bad("remote_block_ids must be a list of lists", groups)
    ids = tuple(tuple(_int(b, "a block ID") for b in g) for g in groups)
    starts_raw = raw.get("remote_starts", [0] * len(ids))
    if not isinstance(starts_raw, list) or len(starts_raw) != len(ids):
        raise _bad(f"remote_starts must list one position per group ({len(ids)})", starts_raw)
    starts = tuple(_int(s, "a start position") for s in starts_raw)
    ranks = raw.get("peer_addresses", [addr])
    if (
        not isinstance(ranks, list)
        or not ranks
        or not all(isinstance(a, str) and ":" in a and _utf8(a) for a in ranks)
    ):
        raise _bad("peer_addresses must list one 'host:port' per prefill TP rank", ranks)
    if ranks[0] != addr:
        raise _bad(f"peer_addresses[0] must equal peer_address {addr!r} (rank 0)", ranks)
    return Ticket(
        addr,
        rid,
        ids,
        starts,
        _int(raw.get("expires_unix_ns", 0), "expires_unix_ns"),
        _int(raw.get("num_tokens", 0), "num_tokens"),
        tuple(ranks) if len(ranks) > 1 else (),
    )


@dataclass(frozen=True)
class HeldBlocks:
    """What the prefill side holds per group: the non-null blocks from position ``start``."""

    ids: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]


def blocks_to_hold(
    kinds: Sequence[GroupKind],
    block_ids: Sequence[Sequence[int]],
    num_tokens: int,
    block_sizes: Sequence[int],
) -> HeldBlocks:
    """The blocks a finished prefill holds, per group: the prompt's blocks (``num_tokens``
    computed tokens) without vLLM's leading null placeholders; a Mamba group keeps its latest
    state only."""
    ids: list[tuple[int, ...]] = []
    starts: list[int] = []
    for kind, group, bs in zip(kinds, block_ids, block_sizes, strict=True):
        blocks = [int(b) for b in group]
        if kind.is_state:
            live = [b for b in blocks if b != NULL_BLOCK]
            ids.append(tuple(live[-1:]))
            starts.append(0)
            continue
        blocks = blocks[: -(-num_tokens // bs)] if bs > 0 else blocks
        start = 0
        while start < len(blocks) and blocks[start] == NULL_BLOCK:
            start += 1
        ids.append(tuple(blocks[start:]))
        starts.append(start)
    return HeldBlocks(tuple(ids), tuple(starts))


@dataclass(frozen=True)
class LocalBlock:
    """One position of a decode request's block table: the block, and whether the pull must
    fill it (allocated for this request, not a prefix-cache hit, not the null block)."""

    block_id: int
    needs_load: bool


@dataclass(frozen=True)
class PullLists:
    """Equal-length remote and local lists per group (what StartPull gets), and the local
    blocks that needed a load the ticket cannot provide (reported as load errors)."""

    remote: tuple[tuple[int, ...], ...]
    local: tuple[tuple[int, ...], ...]
    unfillable: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.local)


def pull_lists(
    kinds: Sequence[GroupKind], ticket: Ticket, local: Sequence[Sequence[LocalBlock]]
) -> PullLists:
    """Pair the decode request's blocks with the held ones, position by position.

    Attention groups: position ``p`` of the local table pairs with remote
    ``remote_block_ids[g][p - remote_starts[g]]``; only positions that need a load are
    pulled, so a prefix-cache hit moves only the missing blocks. Mamba groups: the latest
    held state goes into the latest local state that needs one (docs/domain.md §5)."""
    if len(ticket.remote_block_ids) != len(kinds) or len(local) != len(kinds):
        raise InvalidRequest(
            f"the ticket has {len(ticket.remote_block_ids)} KV cache groups, this engine"
            f" {len(kinds)} (and {len(local)} block tables)",
            field=f"kv_transfer_params.{KEY}.remote_block_ids",
            fix="prefill and decode must serve the same model with the same KV cache groups"
            f" (see {DOC})",
        )
    remote_out: list[tuple[int, ...]] = []
    local_out: list[tuple[int, ...]] = []
    unfillable: list[int] = []
    for kind, held, start, table in zip(
        kinds, ticket.remote_block_ids, ticket.remote_starts, local, strict=True
    ):
        needed = [(p, b.block_id) for p, b in enumerate(table) if b.needs_load]
        if kind.is_state:
            if needed and held:
                remote_out.append((held[-1],))
                local_out.append((needed[-1][1],))
                unfillable.extend(b for _, b in needed[:-1])
            else:
                remote_out.append(())
                local_out.append(())
                unfillable.extend(b for _, b in needed)
            continue
        r: list[int] = []
        loc: list[int] = []
        for p, b in needed:
            i = p - start
            if 0 <= i < len(held) and held[i] != NULL_BLOCK:
                r.append(held[i])
                loc.append(b)
            else:
                unfillable.append(b)
        remote_out.append(tuple(r))
        local_out.append(tuple(loc))
    return PullLists(tuple(remote_out), tuple(local_out), tuple(unfillable))


@dataclass(frozen=True)
class PullJob:
    """One pull the scheduler side planned for the worker side."""

    request_id: str
    peer_addresses: tuple[str, ...]  # the prefill daemon of each TP rank: rank d pulls [d]
    remote_request_id: str
    remote: tuple[tuple[int, ...], ...]
    local: tuple[tuple[int, ...], ...]
    unfillable: tuple[int, ...]
    notify_only: bool  # nothing to load (full local hit): only release the prefill's lease

    def peer_for(self, tp_rank: int) -> str:
        """The prefill daemon that decode rank ``tp_rank`` pulls from ("" when the job has
        none for it: a refused plan)."""
        return self.peer_addresses[tp_rank] if tp_rank < len(self.peer_addresses) else ""


@dataclass(frozen=True)
class Decline:
    """A held prefill the decode side will not pull (its request ended first, or its pull
    could not be planned): the decode engine's ranks decline every prefill rank's hold between
    them, rank ``r`` those of prefill ranks ``r, r + decode_tp, ...`` (each one once, whatever
    the two TP sizes)."""

    remote_request_id: str
    peer_addresses: tuple[str, ...]  # the prefill daemon of each TP rank
    decode_tp: int = 1

    @classmethod
    def of(cls, ticket: Ticket, decode_tp: int) -> Decline:
        return cls(ticket.request_id, ticket.rank_addresses, max(1, decode_tp))

    def peers_for(self, tp_rank: int) -> tuple[str, ...]:
        """The prefill daemons decode rank ``tp_rank`` declines."""
        return self.peer_addresses[tp_rank :: self.decode_tp]


def unpulled_decline(
    params: Mapping[str, Any] | None, *, planned: bool, now_ns: int, decode_tp: int
) -> Decline | None:
    """What a decode request that finished owes the prefill holding its prompt: a
    :class:`Decline` when it carried a live ticket and ended before its pull was planned
    (aborted); None when a pull was planned (its end releases the hold), or the ticket is
    missing, malformed or expired (the hold is gone already)."""
    if planned or not params or not params.get("do_remote_prefill"):
        return None
    try:
        ticket = ticket_from_params(params)
    except KvxferdError:
        return None
    if ticket is None or ticket.expires_unix_ns <= now_ns:
        return None
    return Decline.of(ticket, decode_tp)


def check_prompt(ticket: Ticket, num_prompt_tokens: int) -> None:
    """Refuse a ticket held for another prompt length than this decode request's: the proxy
    paired a request with another's ``kv_transfer_params`` (pulling them would give it another
    prompt's KV cache, or leave positions the ticket cannot fill)."""
    if ticket.num_tokens != num_prompt_tokens:
        raise InvalidRequest(
            f"the ticket holds a prompt of {ticket.num_tokens} tokens, this request's has"
            f" {num_prompt_tokens}",
            field=f"kv_transfer_params.{KEY}.num_tokens",
            fix="send the decode engine the same prompt as the prefill engine, with that"
            f" request's kv_transfer_params (see {DOC}, 'The proxy')",
        )


def check_tp(ticket: Ticket, tp_size: int) -> None:
    """Refuse a ticket from a prefill engine of another TP size than this decode engine's.

    kvxferd's daemons can slice KV heads between different TP sizes, but not vLLM's pages:
    vLLM packs a head's K and V inside each (head, token) cell, so a head slice is not the
    byte ranges kvxferd's head-major slicing moves (docs/vllm.md, "Tensor parallelism")."""
    if ticket.tp_size != tp_size:
        raise InvalidRequest(
            f"the prefill engine runs tensor_parallel_size {ticket.tp_size}, this decode engine"
            f" {tp_size}; the vLLM connector moves KV between engines of the same TP size only"
            " (vLLM's pages pack each head's K and V per token, so a different TP size's head"
            " slice is not a byte range kvxferd can move)",
            field=f"kv_transfer_params.{KEY}.peer_addresses",
            fix=f"run prefill and decode with the same tensor_parallel_size (see {DOC})",
        )


def plan_pull(
    request_id: str,
    ticket: Ticket,
    tables: Sequence[Sequence[LocalBlock]],
    kinds: Sequence[GroupKind],
    num_external_tokens: int,
    *,
    tp_size: int = 1,
) -> tuple[PullJob, KvxferdError | None]:
    """The pull of ``ticket``'s blocks into this request's ``tables`` (one per transfer group),
    by each of this engine's ``tp_size`` ranks from the prefill rank of the same index.
    When they cannot be paired, the job loads nothing and names every block that needed a
    load as unfillable (vLLM recomputes them), and the error says why."""
    notify_only = num_external_tokens == 0  # full local hit: only release the prefill's lease
    try:
        check_tp(ticket, tp_size)
        lists = pull_lists(kinds, ticket, tables)
    except KvxferdError as err:
        bad = tuple(b.block_id for t in tables for b in t if b.needs_load)
        job = PullJob(request_id, (), ticket.request_id, (), (), bad, notify_only)
        return job, err
    job = PullJob(
        request_id,
        ticket.rank_addresses,
        ticket.request_id,
        lists.remote,
        lists.local,
        lists.unfillable,
        notify_only,
    )
    return job, None
