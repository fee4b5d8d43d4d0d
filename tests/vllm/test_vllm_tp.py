"""TP 2 through the vLLM connector's own code paths against real daemons, without vLLM.

Four ``kvxferd serve`` daemons in attached mode, one per worker rank: prefill ranks 0 and 1,
decode ranks 0 and 1 (real processes, NIXL, gRPC). Each rank's "worker" (:class:`RankEngine`)
allocates its KV cache in shared memory as vLLM's CPU worker does inside the connector's
``get_mem_pool_context`` (:class:`SharedKvAllocation`), fills it with its own random bytes (the
two prefill ranks differ, so a decode rank that pulled the wrong rank would be caught), and
attaches it through :func:`attach_shared` at its TP position; what the connector does in
vLLM's hooks is then driven directly:

* the prefill scheduler side holds the finished prompt on both ranks' daemons
  (:class:`RankHolds`, ``request_finished``) and emits the ticket as ``kv_transfer_params``;
* the decode scheduler side reads the ticket and plans the pull (``plan_pull``,
  ``update_state_after_alloc``) into one :class:`PullJob` that both decode ranks get;
* each decode rank's :class:`RankWorker` starts its pull (``start_load_kv``) and reports it
  (``get_finished``, ``get_block_ids_with_load_errors``); :func:`aggregate` counts them as
  vLLM's ``KVOutputAggregator`` does (finished once every rank reported, load errors unioned).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch

from kvxferd.layout.spec import GroupKind
from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.scenario.vllm_engines import DAEMON_EXTRA
from kvxferd.scenario.vllm_pair import held_requests
from kvxferd.vllm.daemon import EngineLink
from kvxferd.vllm.holds import RankHolds
from kvxferd.vllm.host import attach_shared
from kvxferd.vllm.memory import SharedKvAllocation
from kvxferd.vllm.params import (
    Decline,
    LocalBlock,
    PullJob,
    blocks_to_hold,
    plan_pull,
    ticket_from_params,
)
from kvxferd.vllm.pull_link import PullLink
from kvxferd.vllm.spec import translate
from kvxferd.vllm.worker import RankWorker
from tests.service.conftest import Daemons, launch
from tests.vllm.test_vllm_spec import KVCacheConfig, dense

TP = 2
BLOCK = 32  # tokens per block of dense()
FA = [GroupKind.FULL_ATTENTION]
WAIT_S = 60.0


class RankEngine:
    """One worker rank: its KV cache in shared memory, attached to its daemon at (rank, TP)."""

    def __init__(self, socket: str, rank: int, seed: int) -> None:
        self.cfg: KVCacheConfig = dense(num_blocks=16, heads=2)  # 4 KV heads over TP 2
        self.translated = translate(self.cfg, model="m")
        self.alloc = SharedKvAllocation(prefix="kvxferd-vllm-tp-test")
        with self.alloc:  # vLLM allocates its KV buffer inside the connector's context
            self.raw = torch.zeros(self.translated.buffer_size, dtype=torch.int8)
        gen = torch.Generator().manual_seed(seed)
        self.raw.copy_(torch.randint(-128, 128, self.raw.shape, dtype=torch.int8, generator=gen))
        self.views = {}
        for p, r in zip(self.translated.placements, self.translated.spec.regions, strict=True):
            part = self.raw[p.offset : p.offset + r.nbytes]  # [B, H, N, C] as LBHNC lays it
            self.views[p.region] = part.view(torch.bfloat16).view(r.num_blocks, 2, BLOCK, 64)
        self.worker = RankWorker("tp-test", rank, deadline_ms=30_000)
        self.link = EngineLink(socket)
        self.attached = attach_shared(
            self.link,
            self.alloc,
            self.cfg,
            self.views,
            model="m",
            layout="LBHNC",
            backend="CPU_ATTN",
            tp_rank=rank,
            tp_size=TP,
            prefix_caching=False,
            wait_s=30.0,
            on_release=self.worker.on_release,
        )
        self.worker.pull = PullLink(self.attached.pool.peer_address)

    def block(self, block_id: int) -> list[bytes]:
        """The bytes of logical block ``block_id`` in every layer."""
        return [
            bytes(v[block_id].contiguous().view(torch.uint8).numpy()) for v in self.views.values()
        ]

    def close(self) -> None:
        self.worker.close()
        self.link.close()


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    names = [f"{side}{r}" for side in ("prefill", "decode") for r in range(TP)]
    ds = launch(
        tmp_path_factory.mktemp("vllm-tp"),
        *(DaemonOptions(n, "dense:num_blocks=16", extra=DAEMON_EXTRA) for n in names),
    )
    yield ds
    ds.stop()


@pytest.fixture
def ranks(daemons: Daemons) -> Iterator[dict[str, list[RankEngine]]]:
    out: dict[str, list[RankEngine]] = {"prefill": [], "decode": []}
    try:
        for side, base in (("prefill", 10), ("decode", 20)):
            for r in range(TP):
                out[side].append(RankEngine(daemons[f"{side}{r}"].engine_socket, r, base + r))
        yield out
    finally:
        for engines in out.values():
            for e in engines:
                e.close()


def _sockets(daemons: Daemons, side: str) -> list[str]:
    return [daemons[f"{side}{r}"].engine_socket for r in range(TP)]


def aggregate(
    workers: list[RankWorker], finished: Iterable[str], want: str, which: int
) -> tuple[set[str], set[int]]:
    """Poll every rank's ``get_finished`` until ``want`` is finished on all of them (``which``:
    0 sending, 1 recving), counting as vLLM's KVOutputAggregator does; returns the requests
    every rank reported and the union of the ranks' load errors. Sending: the connector kept
    ``want``'s blocks (``KvxferdMetadata.delayed``), so each rank awaits its release."""
    if which == 0:
        for w in workers:
            w.await_release([want])
    counts: Counter[str] = Counter()
    errors: set[int] = set()
    seen = set(finished)
    deadline = time.monotonic() + WAIT_S
    while counts[want] < len(workers):
        assert time.monotonic() < deadline, f"{want}: {counts[want]} of {len(workers)} ranks"
        for w in workers:
            counts.update(w.finished(seen)[which])
            errors |= w.load_errors()
        time.sleep(0.05)
    return {r for r, n in counts.items() if n == len(workers)}, errors


def _decode_plan(params: dict[str, object], rid: str, local: list[LocalBlock]) -> PullJob:
    ticket = ticket_from_params(json.loads(json.dumps(params)))  # through the proxy, as JSON
    assert ticket is not None
    needed = sum(b.needs_load for b in local)
    job, err = plan_pull(rid, ticket, [local], FA, needed * BLOCK, tp_size=TP)
    assert err is None, err
    return job


def test_tp2_request_moves_rank_by_rank_and_every_rank_reports_it(
    daemons: Daemons, ranks: dict[str, list[RankEngine]]
) -> None:
    prefill, decode = ranks["prefill"], ranks["decode"]
    assert prefill[0].block(3) != prefill[1].block(3)  # the ranks' bytes differ
    assert prefill[0].attached.pool.peer_address != prefill[1].attached.pool.peer_address
    holds = RankHolds(_sockets(daemons, "prefill"))
    try:
        # A 80-token prompt in prefill blocks 3, 4, 5; decode allocated 7, 8, 9.
        out = holds.hold("req-A", blocks_to_hold(FA, [[3, 4, 5]], 80, [BLOCK]), 80)
        assert out.ticket is not None and out.unheld == () and out.held == (0, 1)
        params = out.ticket.to_params()
        addrs = [p.attached.pool.peer_address for p in prefill]
        assert params["kvxferd"]["peer_addresses"] == addrs
        job = _decode_plan(params, "req-A", [LocalBlock(b, True) for b in (7, 8, 9)])
        for d in decode:
            d.worker.start([job])
            d.worker.start([job])  # vLLM's metadata may repeat a job: started once
        done, errors = aggregate([d.worker for d in decode], (), "req-A", 1)
        assert done == {"req-A"} and errors == set()
        for d in range(TP):  # decode rank d holds prefill rank d's bytes, not the other's
            for local, remote in ((7, 3), (8, 4), (9, 5)):
                assert decode[d].block(local) == prefill[d].block(remote)
            assert decode[d].block(7) != prefill[1 - d].block(3)
        sent, _ = aggregate([p.worker for p in prefill], {"req-A"}, "req-A", 0)
        assert sent == {"req-A"}  # each rank's hold released by its reader: vLLM may free

        # A prefix hit on decode: block 10 (position 0) is cached, 11 and 12 must move.
        out = holds.hold("req-B", blocks_to_hold(FA, [[3, 4, 5]], 80, [BLOCK]), 80)
        assert out.ticket is not None
        table = [LocalBlock(10, False), LocalBlock(11, True), LocalBlock(12, True)]
        job = _decode_plan(out.ticket.to_params(), "req-B", table)
        assert job.remote == ((4, 5),) and job.local == ((11, 12),)
        before = [d.block(10) for d in decode]
        for d in decode:
            d.worker.start([job])
        done, errors = aggregate([d.worker for d in decode], (), "req-B", 1)
        assert done == {"req-B"} and errors == set()
        for d in range(TP):
            assert decode[d].block(11) == prefill[d].block(4)
            assert decode[d].block(12) == prefill[d].block(5)
            assert decode[d].block(10) == before[d]  # the cached block was not written
        aggregate([p.worker for p in prefill], {"req-B"}, "req-B", 0)
    finally:
        holds.close()
    assert [held_requests(s) for s in _sockets(daemons, "prefill")] == [0, 0]


def test_a_failed_rank_surfaces_its_blocks_as_load_errors(
    daemons: Daemons, ranks: dict[str, list[RankEngine]]
) -> None:
    prefill, decode = ranks["prefill"], ranks["decode"]
    holds = RankHolds(_sockets(daemons, "prefill"))
    try:
        out = holds.hold("req-F", blocks_to_hold(FA, [[1, 2]], 64, [BLOCK]), 64)
        assert out.ticket is not None
        job = _decode_plan(out.ticket.to_params(), "req-F", [LocalBlock(b, True) for b in (5, 6)])
        # Prefill rank 1's KV cache leaves its daemon (its engine session ends, as when that
        # worker goes away): the daemon drops rank 1's hold, so decode rank 1's pull fails.
        prefill[1].link.close()
        for d in decode:
            d.worker.start([job])
        done, errors = aggregate([d.worker for d in decode], (), "req-F", 1)
        # Both ranks report the request finished; rank 1's blocks are load errors, so vLLM's
        # kv_load_failure_policy (recompute or fail) applies to the request.
        assert done == {"req-F"} and errors == {5, 6}
        assert decode[0].block(5) == prefill[0].block(1)  # rank 0 pulled its share
        sent, _ = aggregate([prefill[0].worker], {"req-F"}, "req-F", 0)
        assert sent == {"req-F"}  # rank 0's hold was released by its reader
    finally:
        holds.close()


def test_a_rank_that_cannot_hold_reports_the_request_sent_at_once(
    daemons: Daemons, ranks: dict[str, list[RankEngine]]
) -> None:
    prefill = ranks["prefill"]
    prefill[1].link.close()  # rank 1's daemon has no KV cache attached: its Hold is refused
    holds = RankHolds(_sockets(daemons, "prefill"), ttl_ms=500)
    try:
        out = holds.hold("req-P", blocks_to_hold(FA, [[1, 2]], 64, [BLOCK]), 64)
        assert out.ticket is None and out.held == (0,) and out.unheld == (1,)
        assert len(out.errors) == 1 and out.errors[0].startswith("TP rank 1: ")
        # The connector returns delay_free with no ticket, and tells rank 1 (KvxferdMetadata.
        # unheld) to report it sent; rank 0 reports it when its hold's lease lapses.
        prefill[1].worker.release_unheld(["req-P"])
        sent, _ = aggregate([p.worker for p in prefill], {"req-P"}, "req-P", 0)
        assert sent == {"req-P"}
    finally:
        holds.close()
    assert held_requests(_sockets(daemons, "prefill")[0]) == 0


def test_a_decode_request_aborted_before_its_pull_frees_every_prefill_ranks_hold_at_once(
    daemons: Daemons, ranks: dict[str, list[RankEngine]]
) -> None:
    """KvxferdMetadata.declines: each decode rank declines its own prefill rank's hold
    (DeclinePull on its daemon), so each prefill rank reports the request sent long before
    the hold's 60 s lease would lapse, and vLLM may free the blocks."""
    prefill, decode = ranks["prefill"], ranks["decode"]
    holds = RankHolds(_sockets(daemons, "prefill"), ttl_ms=60_000)
    try:
        out = holds.hold("req-D", blocks_to_hold(FA, [[1, 2]], 64, [BLOCK]), 64)
        assert out.ticket is not None and out.held == (0, 1)
        assert [held_requests(s) for s in _sockets(daemons, "prefill")] == [1, 1]
        t0 = time.monotonic()
        for d in decode:
            d.worker.decline([Decline.of(out.ticket, TP)])
        sent, _ = aggregate([p.worker for p in prefill], {"req-D"}, "req-D", 0)
        assert sent == {"req-D"} and time.monotonic() - t0 < 30
    finally:
        holds.close()
    assert [held_requests(s) for s in _sockets(daemons, "prefill")] == [0, 0]


def test_engine_sockets_with_rank_placeholder_point_at_each_ranks_daemon(
    daemons: Daemons, tmp_path: Path
) -> None:
    """The paths the daemons of this test listen on fit a ``{rank}`` template, so one
    ``engine_socket`` in the connector's config reaches both ranks."""
    from kvxferd.vllm.settings import engine_sockets

    socks = _sockets(daemons, "prefill")
    template = socks[0].replace("prefill0", "prefill{rank}")
    assert engine_sockets(template, TP) == tuple(socks)
    assert engine_sockets(socks, TP) == tuple(socks)
