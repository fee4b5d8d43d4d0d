"""What ``/metrics`` reads at scrape time, and the per-pull outcomes it counts."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable

from kvxferd.daemon.core import Daemon
from kvxferd.daemon.pulls import PullRecord
from kvxferd.metrics import ACTIVE_STATES, LiveState, Metrics
from kvxferd.staging.stats import Occupancy
from kvxferd.transfer import TransferEngine

log = logging.getLogger(__name__)


def live_source(
    daemon: Daemon, engine: TransferEngine, loop: asyncio.AbstractEventLoop
) -> Callable[[], LiveState | None]:
    """The live metrics' source: a snapshot taken on the daemon's loop (its state is the
    loop's alone), asked for from the HTTP thread; None if the loop does not answer in 2 s."""

    def snapshot() -> LiveState:
        pulls: dict[str, int] = dict.fromkeys(ACTIVE_STATES, 0)
        for rec in daemon.reader.pulls.active():
            pulls[rec.state.value] = pulls.get(rec.state.value, 0) + 1
        links = daemon.peers.links() if daemon.peers is not None else []
        by_state: dict[str, int] = {}
        inflight: dict[str, int] = {}
        transports: dict[str, tuple[str, float]] = {}
        for link in links:
            by_state[link.state.value] = by_state.get(link.state.value, 0) + 1
            if link.remote is not None:
                inflight[link.address] = engine.inflight_bytes(link.remote.agent_name)
            t = link.transport
            if t is not None:
                gbps = 0.0 if t.read_gbps != t.read_gbps else t.read_gbps  # NaN: not probed
                transports[link.address] = (t.name, gbps)
        staging = daemon.staging
        occ = None
        if staging is not None and staging.owner is not None:
            occ = staging.owner.occupancy()
        elif staging is not None and staging.ring is not None:
            ring = staging.ring
            occ = Occupancy(
                slots=ring.info.chunks, free=ring.free_slots, reader_cap=0, local=ring.taken_slots
            )
        slot = daemon.slot
        pool_bytes = slot.current().spec.nbytes if slot.registered else 0
        ring_bytes = 0
        if staging is not None and staging.ring is not None:
            ring_bytes = staging.ring.info.chunks * staging.ring.info.chunk_bytes
        return LiveState(
            pulls,
            inflight,
            by_state,
            len(daemon.leases),
            occ,
            transports,
            registered_bytes=pool_bytes,
            staging_ring_bytes=ring_bytes,
            pool_generation=slot.generation,
        )

    def source() -> LiveState | None:
        if loop.is_closed():
            return None
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            return snapshot()  # scraped from the loop itself (in-process tests)
        done: concurrent.futures.Future[LiveState] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(snapshot())
            except BaseException as exc:
                done.set_exception(exc)

        try:
            loop.call_soon_threadsafe(run)
            return done.result(timeout=2.0)
        except Exception:
            log.warning("live metrics unavailable: the daemon's loop did not answer")
            return None

    return source


def observe_pulls(daemon: Daemon, metrics: Metrics) -> None:
    """Per-peer outcome and latency of every pull, from the daemon's pull book: a listener on
    its pulls' ends (run after the pull's answer, not a task woken at every change)."""

    def ended(rec: PullRecord) -> None:
        seconds = max(0.0, (rec.finished_ns - rec.created_ns) / 1e9)
        metrics.observe_pull_end(rec.peer_address, rec.state.value, seconds)

    daemon.reader.pulls.on_end(ended)


__all__ = ["live_source", "observe_pulls"]
