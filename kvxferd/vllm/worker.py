"""The worker side's pulls and releases for one TP rank (no vLLM import).

Every worker rank of a vLLM engine runs its own connector beside its own kvxferd daemon and
gets the same per-step metadata from the scheduler. :class:`RankWorker` is what one rank keeps:

* ``start``: for each planned :class:`~kvxferd.vllm.params.PullJob`, one pull on this rank's
  daemon from the prefill daemon of the same rank (``job.peer_for(tp_rank)``);
* ``finished``: what vLLM's ``get_finished`` returns for this rank: the decode requests whose
  pull on this rank ended (DONE or not: a failed pull's blocks are in ``load_errors``), and the
  prefill requests whose hold this rank's daemon released (or that the scheduler could not
  hold on this rank, :meth:`release_unheld`). vLLM counts a request finished once every worker
  reported it (``KVOutputAggregator``), so each rank reports only its own share, and only for
  the requests the connector told vLLM to keep (:meth:`await_release`), each once: vLLM's
  scheduler asserts that a request it is told was sent still exists;
* ``decline``: for each decode request that ended before its pull (or could not be planned),
  tell this rank's share of the prefill daemons it will not be read (DeclinePull), so their
  holds end now;
* ``load_errors``: the local blocks of this rank's failed pulls (vLLM unions every rank's, so
  one rank's failure makes vLLM's ``kv_load_failure_policy`` apply to the request).

The connector (:mod:`kvxferd.vllm.connector`) calls these from vLLM's hooks; tests drive them
directly against real daemons (tests/vllm/test_vllm_tp.py).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable

from kvxferd.vllm.daemon import Release
from kvxferd.vllm.params import Decline, PullJob
from kvxferd.vllm.pull_link import PullLink, PullResult

# vLLM's logger tree: inside vLLM these lines go through its handler, format and level.
log = logging.getLogger("vllm.kvxferd")

# A release for a request nobody awaits is kept this many get_finished calls in case the
# scheduler's word that it awaits one is still on its way (it comes in the metadata of the
# step whose finished_req_ids name the request, one or two steps after the Hold), then dropped.
UNCLAIMED_STEPS = 64


class RankWorker:
    """One worker rank's pulls, releases and load errors (see the module doc)."""

    def __init__(self, engine_id: str, tp_rank: int = 0, *, deadline_ms: int = 0) -> None:
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.deadline_ms = deadline_ms
        self.pull: PullLink | None = None  # set once the KV cache is attached
        self._lock = threading.Lock()
        self._started: set[str] = set()
        self._notify_only: set[str] = set()
        self._done_recv: set[str] = set()
        self._load_errors: set[int] = set()
        self._awaiting: set[str] = set()  # vLLM keeps their blocks until this rank reports them
        self._released: set[str] = set()  # awaited and released: reported at the next finished
        self._unclaimed: dict[str, int] = {}  # released, not (yet) awaited: -> self._step then
        self._step = 0

    def transfer_id(self, request_id: str) -> str:
        return f"vllm-{self.engine_id}-r{self.tp_rank}-{request_id}"

    def start(self, jobs: Iterable[PullJob]) -> None:
        """Start this rank's pull of every job not started yet."""
        for job in jobs:
            with self._lock:
                if job.request_id in self._started:
                    continue
                self._started.add(job.request_id)
                self._load_errors.update(job.unfillable)
                if job.notify_only:
                    self._notify_only.add(job.request_id)
            peer = job.peer_for(self.tp_rank)
            if self.pull is None or not job.remote or not peer:
                if self.pull is None:
                    why = "the KV cache is not attached to a daemon"
                elif not job.remote:
                    why = "the ticket does not fit this engine's KV cache groups"
                else:
                    why = f"the ticket names no prefill daemon for TP rank {self.tp_rank}"
                self.pull_done(
                    PullResult(job.request_id, "", "REFUSED", error=why, local=job.local),
                    job.request_id,
                )
                continue
            self.pull.start(
                self.transfer_id(job.request_id),
                job.remote_request_id,
                peer,
                job.remote,
                job.local,
                deadline_ms=self.deadline_ms,
                on_done=functools.partial(
                    self.pull_done,
                    request_id=job.request_id,
                    decline=(job.remote_request_id, peer),
                ),
            )

    def decline(self, declines: Iterable[Decline]) -> None:
        """Tell this rank's prefill daemon of each declined request that it will not be
        pulled (the decode request ended first), so its blocks are freed now."""
        pull = self.pull
        if pull is None:
            return
        for d in declines:
            for peer in d.peers_for(self.tp_rank):
                pull.decline(d.remote_request_id, peer)

    def pull_done(
        self,
        result: PullResult,
        request_id: str | None = None,
        decline: tuple[str, str] | None = None,
    ) -> None:
        """A pull of this rank ended (on the pull's thread, or at once when refused). One the
        daemon refused never read the prefill's hold: ``decline`` it, so the prefill engine
        gets its blocks back now rather than at the lease's TTL (``decline``: the held
        request's ID and the prefill daemon this rank pulled from)."""
        rid = request_id or result.request_id
        if result.state == "REFUSED" and decline is not None and self.pull is not None:
            self.pull.decline(*decline)
        with self._lock:
            if result.state != "DONE":
                failed = result.invalid_local or tuple(b for g in result.local for b in g)
                self._load_errors.update(failed)
                log.error(
                    "kvxferd: TP rank %d: pulling the KV cache of request %s from %s ended %s;"
                    " %d blocks will follow vLLM's kv_load_failure_policy: %s",
                    self.tp_rank,
                    rid,
                    result.transfer_id or "(not started)",
                    result.state,
                    len(failed),
                    result.error or "(no error detail)",
                )
            if rid in self._notify_only:
                self._notify_only.discard(rid)
                self._started.discard(rid)
            else:
                self._done_recv.add(rid)

    def await_release(self, request_ids: Iterable[str]) -> None:
        """Finished prefills whose blocks vLLM keeps until this rank reports them sent (the
        connector's ``request_finished`` returned True): only these are ever reported, once."""
        with self._lock:
            for rid in request_ids:
                self._awaiting.add(rid)
                if self._unclaimed.pop(rid, None) is not None:  # released before we heard
                    self._released.add(rid)

    def _release(self, rid: str, why: str) -> None:
        if rid in self._awaiting:
            self._released.add(rid)
        else:  # not awaited (yet): vLLM freed it already, or this rank reported it already
            self._unclaimed[rid] = self._step
            log.debug("kvxferd: TP rank %d: %s %s, not awaited", self.tp_rank, why, rid)

    def on_release(self, rel: Release) -> None:
        """This rank's daemon released a held prefill (on the engine session's thread)."""
        if rel.reason != "DONE":
            log.warning(
                "kvxferd: TP rank %d: the daemon released held request %s (%s) before a reader"
                " finished; its blocks are freed",
                self.tp_rank,
                rel.request_id,
                rel.reason,
            )
        with self._lock:
            self._release(rel.request_id, f"released ({rel.reason})")

    def release_unheld(self, request_ids: Iterable[str]) -> None:
        """Prefill requests the scheduler could not hold on this rank: nothing will be
        released here, so report them sent (vLLM waits for every rank before it frees)."""
        with self._lock:
            for rid in request_ids:
                self._release(rid, "not held")

    def finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """``(sending, recving)`` for vLLM's ``get_finished``: awaited prefills released on
        this rank, decode pulls of this rank that ended. A release nobody awaits is dropped
        once vLLM finished the request without awaiting it, or after UNCLAIMED_STEPS calls."""
        with self._lock:
            self._step += 1
            for rid in finished_req_ids:
                if rid not in self._awaiting and self._unclaimed.pop(rid, None) is not None:
                    log.debug("kvxferd: dropped the release of %s: vLLM freed it", rid)
            stale = [r for r, s in self._unclaimed.items() if self._step - s > UNCLAIMED_STEPS]
            for rid in stale:
                del self._unclaimed[rid]
                log.debug("kvxferd: dropped the release of %s: not awaited", rid)
            sending, self._released = self._released, set()
            self._awaiting -= sending
            recving = set(self._done_recv)
            self._done_recv.clear()
            self._started -= recving
        return sending, recving

    def load_errors(self) -> set[int]:
        """The local blocks this rank could not load since the last call."""
        with self._lock:
            out = set(self._load_errors)
            self._load_errors.clear()
        return out

    def close(self) -> None:
        if self.pull is not None:
            self.pull.close()


__all__ = ["RankWorker"]
