"""What a worker rank does with its pulls' ends and its releases (kvxferd/vllm/worker.py),
without vLLM or daemons: a pull the daemon refused declines the prefill's hold; a prefill
request is reported sent (vLLM's ``get_finished``) only when the connector told vLLM to keep
its blocks (``request_finished`` returned True, ``KvxferdMetadata.delayed``), once per rank,
however late its release comes; releases of other requests are dropped. vLLM's scheduler
asserts that a request reported sent still exists, and its ``KVOutputAggregator`` counts one
report per rank."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from kvxferd.vllm.daemon import Release
from kvxferd.vllm.params import PullJob
from kvxferd.vllm.pull_link import PullResult
from kvxferd.vllm.worker import UNCLAIMED_STEPS, RankWorker


def _sent(w: RankWorker, finished: set[str] | None = None, steps: int = 1) -> set[str]:
    out: set[str] = set()
    for _ in range(steps):
        out |= w.finished(finished or set())[0]
        finished = None
    return out


def test_a_release_of_a_request_vllm_freed_is_never_reported() -> None:
    # Hold's answer was lost (timeout, reset) but the daemon held: the connector returned
    # delay_free=False, vLLM freed the request. Before, the lease's release 60 s later was
    # reported in finished_sending and vLLM's scheduler died on its assertion.
    w = RankWorker("eng", 0)
    assert _sent(w, {"p-1"}) == set()  # finished, never awaited
    w.on_release(Release("p-1", "EXPIRED"))
    assert _sent(w, steps=UNCLAIMED_STEPS + 2) == set()
    assert w._unclaimed == {}  # dropped, not kept


def test_a_release_before_the_schedulers_word_is_reported_once_it_comes() -> None:
    w = RankWorker("eng", 0)
    w.on_release(Release("p-2", "DONE"))  # the reader was fast: before the next step's metadata
    assert _sent(w) == set()  # not awaited yet (with async scheduling, a step may come first)
    w.await_release(["p-2"])  # start_load_kv: KvxferdMetadata.delayed
    assert _sent(w, {"p-2"}) == {"p-2"}
    w.on_release(Release("p-2", "DONE"))  # a second release: already reported
    assert _sent(w, steps=3) == set()


def test_a_release_after_65536_other_finishes_is_still_reported() -> None:
    # Before, a release was reported only while its request was in a cache of the last 65,536
    # finished requests: a later one (an EXPIRED lease at > ~1.1k req/s) was never reported
    # and vLLM never freed the prefill's blocks.
    w = RankWorker("eng", 0)
    w.await_release(["held-1"])
    assert _sent(w, {"held-1"}) == set()
    for i in range(0, 70_000, 4096):
        w.finished({f"other-{j}" for j in range(i, i + 4096)})
    w.on_release(Release("held-1", "EXPIRED"))
    assert _sent(w) == {"held-1"}
    assert w._awaiting == set()  # nothing left behind


def test_tp2_each_rank_reports_a_kept_request_once_when_one_ranks_hold_was_unknown() -> None:
    """TP 2: rank 0 held, rank 1's Hold got no answer (its daemon held all the same). The
    connector returns delay_free=True with no ticket and tells rank 1 to report it at once
    (KvxferdMetadata.unheld). Rank 1's lease releases it later: before, rank 1 then reported
    it a second time, leaving an entry in vLLM's KVOutputAggregator (or finishing it before
    rank 0 released)."""
    ranks = [RankWorker("eng", r) for r in range(2)]
    counts: Counter[str] = Counter()
    complete: list[str] = []

    def step(finished: set[str]) -> None:  # vLLM's KVOutputAggregator
        for w in ranks:
            for rid in w.finished(finished)[0]:
                counts[rid] += 1
                if counts[rid] == len(ranks):
                    complete.append(rid)
                    del counts[rid]

    for w in ranks:
        w.await_release(["p-3"])
    ranks[1].release_unheld(["p-3"])
    step({"p-3"})
    assert complete == [] and counts == {"p-3": 1}
    ranks[1].on_release(Release("p-3", "EXPIRED"))  # rank 1's unknown hold lapses first
    step(set())
    assert complete == [] and counts == {"p-3": 1}
    ranks[0].on_release(Release("p-3", "EXPIRED"))
    step(set())
    assert complete == ["p-3"] and counts == {}
    for _ in range(5):
        step(set())
    assert complete == ["p-3"] and counts == {}


class _Link:
    """A PullLink whose daemon answers each StartPull with ``state`` at once."""

    def __init__(self, state: str) -> None:
        self.state = state
        self.declined: list[tuple[str, str]] = []

    def start(
        self,
        transfer_id: str,
        request_id: str,
        peer: str,
        remote: object,
        local: object,
        *,
        deadline_ms: int,
        on_done: Callable[[PullResult], None],
    ) -> None:
        on_done(PullResult(request_id, transfer_id, self.state, local=((5, 6),)))

    def decline(self, request_id: str, peer_address: str) -> None:
        self.declined.append((request_id, peer_address))


@pytest.mark.parametrize(("state", "declined"), [("REFUSED", True), ("FAILED", False)])
def test_a_refused_pull_declines_the_hold_it_never_read(state: str, declined: bool) -> None:
    # Before, a StartPull the daemon refused (a handshake mismatch, a bad block ID) left the
    # prefill's blocks held for nobody until the lease's TTL. A pull that ran (FAILED,
    # CANCELLED, ...) settles the hold itself.
    job = PullJob("dec-1", ("10.0.0.5:1", "10.0.0.5:2"), "cmpl-1", ((7, 8),), ((5, 6),), (), False)
    w = RankWorker("eng", 1)
    link = _Link(state)
    w.pull = link  # type: ignore[assignment]
    w.start([job])
    assert link.declined == ([("cmpl-1", "10.0.0.5:2")] if declined else [])  # rank 1's prefill
    assert w.finished(set())[1] == {"dec-1"} and w.load_errors() == {5, 6}
