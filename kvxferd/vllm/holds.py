"""The scheduler side's holds: a finished prefill held on every TP rank's daemon (no vLLM
import).

vLLM's scheduler runs once per engine, its workers once per TP rank, each beside its own
kvxferd daemon (docs/vllm.md, "Tensor parallelism"). When a prefill finishes, the scheduler
side calls ``Hold`` on every rank's daemon over its Engine socket, at once (the ranks share
one block table, so the block IDs are the same on each), and writes one ticket that names
every rank's daemon. A rank whose hold failed may never see a release, so the connector tells
that rank's worker to report the request sent at once (:attr:`HoldOutcome.unheld`), and the
ranks that did hold release theirs when the hold's lease lapses (no decode engine gets a
ticket for it). A failed Hold may still have held (its answer was lost: a timeout, a reset
connection); that lease's release comes later for a request already reported or freed, and
the worker drops it (:meth:`kvxferd.vllm.worker.RankWorker.await_release`).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvxferd.errors import KvxferdError
from kvxferd.v1 import engine_pb2
from kvxferd.vllm.daemon import EngineLink
from kvxferd.vllm.params import HeldBlocks, Ticket


@dataclass(frozen=True)
class HoldOutcome:
    """What holding one finished prefill on every rank gave.

    ``ticket``: set when every rank held it. ``held``: the ranks that hold it (each releases it
    when a reader is done or its lease lapses); ``unheld``: the ranks that do not, with
    ``errors`` saying why per rank."""

    ticket: Ticket | None
    held: tuple[int, ...]
    unheld: tuple[int, ...]
    errors: tuple[str, ...]


# Hold runs on vLLM's scheduler loop (request_finished), which waits for it: a local call that
# answers in about a millisecond, so a daemon silent this long is wedged, and every finished
# prompt would otherwise stall the whole engine for the generic 30 s call timeout. A Hold whose
# answer is lost is safe: the request is reported sent at once on that rank, and a late
# release of it is dropped (kvxferd/vllm/worker.py).
HOLD_TIMEOUT_S = 5.0


class RankHolds:
    """``Hold`` on each TP rank's daemon (``sockets[r]`` is rank ``r``'s Engine socket)."""

    def __init__(self, sockets: Sequence[str], *, token: str = "", ttl_ms: int = 0) -> None:
        self.links = [EngineLink(s, token=token) for s in sockets]
        self.ttl_ms = ttl_ms
        self._pool = (
            ThreadPoolExecutor(len(self.links), thread_name_prefix="kvxferd-hold")
            if len(self.links) > 1
            else None
        )

    @property
    def tp_size(self) -> int:
        return len(self.links)

    def _hold_one(
        self, link: EngineLink, request_id: str, held: HeldBlocks
    ) -> engine_pb2.HoldResponse | KvxferdError:
        try:
            return link.hold(
                request_id, held.ids, readers=1, ttl_ms=self.ttl_ms, timeout_s=HOLD_TIMEOUT_S
            )
        except KvxferdError as err:
            return err

    def hold(self, request_id: str, held: HeldBlocks, num_tokens: int) -> HoldOutcome:
        """Hold ``held`` under ``request_id`` on every rank (one reader each: decode rank
        ``r`` of an engine of the same TP size)."""
        if self._pool is None:
            answers = [self._hold_one(self.links[0], request_id, held)]
        else:
            futures = [self._pool.submit(self._hold_one, ln, request_id, held) for ln in self.links]
            answers = [f.result() for f in futures]
        ok: list[tuple[int, engine_pb2.HoldResponse]] = []
        errors: list[str] = []
        for rank, ans in enumerate(answers):
            if isinstance(ans, KvxferdError):
                errors.append(f"TP rank {rank}: {ans}")
            elif ans.request_id != request_id:
                errors.append(
                    f"TP rank {rank}: the daemon held it as {ans.request_id!r}, not"
                    f" {request_id!r}; every rank must hold it under one request ID"
                )
            else:
                ok.append((rank, ans))
        held_ranks = tuple(r for r, _ in ok)
        unheld = tuple(r for r in range(self.tp_size) if r not in held_ranks)
        if unheld:
            return HoldOutcome(None, held_ranks, unheld, tuple(errors))
        addrs = tuple(resp.peer_address for _, resp in ok)
        ticket = Ticket(
            addrs[0],
            request_id,
            held.ids,
            held.starts,
            min(int(resp.expires_unix_ns) for _, resp in ok),
            num_tokens,
            addrs if len(addrs) > 1 else (),
        )
        return HoldOutcome(ticket, held_ranks, (), ())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        for link in self.links:
            link.close()


__all__ = ["HoldOutcome", "RankHolds"]
