"""Series read from the daemon's state at each scrape, so they cannot drift from it.

:class:`ScrapeStart` is registered first and takes one :class:`LiveState` snapshot per
scrape (and expires idle peers); :class:`LiveCollector` turns that snapshot into gauges.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvxferd import busypoll
from kvxferd.metrics.peer_labels import PeerLabels
from kvxferd.metrics.values import ACTIVE_STATES, LINK_STATES
from kvxferd.staging.stats import Occupancy


@dataclass(frozen=True)
class LiveState:
    """What :class:`LiveCollector` reports, read from the daemon at one moment."""

    pulls: Mapping[str, int] = field(default_factory=dict)  # non-terminal pulls by state
    inflight_bytes: Mapping[str, int] = field(default_factory=dict)  # by peer address
    links: Mapping[str, int] = field(default_factory=dict)  # peer links by LinkState value
    leases: int = 0
    staging: Occupancy | None = None
    # peer address -> (transport serving READs from it, probe READ GB/s; kvxferd.ipc.transport)
    transports: Mapping[str, tuple[str, float]] = field(default_factory=dict)
    registered_bytes: int = 0  # the KV pool's memory registered with NIXL (0: no pool)
    staging_ring_bytes: int = 0  # the staging ring's (0: staging disabled)
    pool_generation: int = 0  # the pool slot's registration generation


class LiveSource(Protocol):
    def __call__(self) -> LiveState | None: ...


class ScrapeStart(Collector):
    """Registered first, so it runs first in every scrape: takes the live snapshot and
    expires idle peers before any series is collected (an expired peer's series are then
    gone from this very scrape)."""

    def __init__(self, peers: PeerLabels) -> None:
        self.peers = peers
        self.source: LiveSource | None = None
        self.state: LiveState | None = None

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self.source() if self.source is not None else None
        self.state = state
        busy = [p for p, n in state.inflight_bytes.items() if n] if state is not None else []
        self.peers.expire(busy)
        return iter(())


class LiveCollector(Collector):
    """Series read from the daemon at scrape time (the source returns None while the daemon
    is not up, or its loop did not answer in time: those series are then left out)."""

    def __init__(self, start: ScrapeStart, peers: PeerLabels) -> None:
        self._start = start
        self._peers = peers

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # no samples at registration time (the daemon may not exist yet)

    def collect(self) -> Iterator[Metric]:
        state = self._start.state
        if state is None:
            return
        pulls = GaugeMetricFamily(
            "kvxferd_pulls",
            "Pulls not yet terminal, by state: PENDING, HANDSHAKING and CONFIRMING are"
            " waiting (for the peer, for the lease), TRANSFERRING is running.",
            labels=["state"],
        )
        for s in ACTIVE_STATES:
            pulls.add_metric([s], state.pulls.get(s, 0))
        yield pulls
        yield GaugeMetricFamily(
            "kvxferd_inflight_transfers",
            "Pulls not yet terminal (the sum of kvxferd_pulls).",
            value=sum(state.pulls.get(s, 0) for s in ACTIVE_STATES),
        )
        inflight = GaugeMetricFamily(
            "kvxferd_inflight_bytes",
            "Bytes of READs posted and not yet complete, per peer (the budget is"
            " transfer.max_inflight_bytes_per_peer).",
            labels=["peer"],
        )
        per_peer: dict[str, int] = dict.fromkeys(self._peers.tracked(), 0)
        for peer, n in state.inflight_bytes.items():
            label = self._peers.label(peer) if n or peer in per_peer else None
            if label is not None:
                per_peer[label] = per_peer.get(label, 0) + n
        for peer, n in sorted(per_peer.items()):
            inflight.add_metric([peer], n)
        yield inflight
        links = GaugeMetricFamily(
            "kvxferd_peers", "Peer links this daemon keeps, by handshake state.", labels=["state"]
        )
        for s in LINK_STATES:
            links.add_metric([s], state.links.get(s, 0))
        yield links
        yield GaugeMetricFamily(
            "kvxferd_leases_active", "Requests held for readers (owner side).", value=state.leases
        )
        yield GaugeMetricFamily(
            "kvxferd_registered_bytes",
            "KV pool memory registered with NIXL (the staging ring is"
            " kvxferd_staging_ring_bytes; 0 while an attached daemon has no pool).",
            value=state.registered_bytes,
        )
        yield GaugeMetricFamily(
            "kvxferd_staging_ring_bytes",
            "Staging ring memory registered with NIXL (0: staging disabled).",
            value=state.staging_ring_bytes,
        )
        yield GaugeMetricFamily(
            "kvxferd_pool_generation",
            "Registration generation of the pool (bumped on every attach and detach).",
            value=state.pool_generation,
        )
        occ = state.staging
        slots = GaugeMetricFamily(
            "kvxferd_staging_slots",
            "Staging ring slots by use: free, granted (to readers' Gathers, owner side),"
            " local (this daemon's own STAGED pulls, reader side). All 0 without a ring.",
            labels=["use"],
        )
        slots.add_metric(["free"], occ.free if occ else 0)
        slots.add_metric(["granted"], occ.granted_total if occ else 0)
        slots.add_metric(["local"], occ.local if occ else 0)
        yield slots
        yield GaugeMetricFamily(
            "kvxferd_staging_gathers_waiting",
            "Gathers queued for a free staging slot (owner side).",
            value=occ.waiting_total if occ else 0,
        )
        transport = GaugeMetricFamily(
            "kvxferd_peer_read_transport",
            "What serves READs from each handshaken peer (transport label: cuda_ipc, rdma,"
            " tcp, cma, unknown; tcp for GPU memory refuses DIRECT and STAGED pulls unless"
            " transfer.allow_slow_transport); the value is the connect-time probe READ's GB/s.",
            labels=["peer", "transport"],
        )
        best: dict[tuple[str, str], float] = {}
        for peer, (name, gbps) in sorted(state.transports.items()):
            key = (self._peers.label(peer), name)
            best[key] = max(best.get(key, 0.0), gbps)
        for (peer, name), gbps in sorted(best.items()):
            transport.add_metric([peer, name], gbps)
        yield transport
        poll = busypoll.active()
        yield GaugeMetricFamily(
            "kvxferd_busy_poll",
            "1 while the event loop polls for server.busy_poll_window_ms after each call"
            " instead of sleeping (server.busy_poll), 0 when it does not.",
            value=1 if poll is not None else 0,
        )
        yield CounterMetricFamily(
            "kvxferd_busy_poll_seconds",
            "Seconds the event loop has spent polling instead of sleeping (busy polling's CPU"
            " cost: up to one core for as long as it polls).",
            value=poll.polled_s if poll is not None else 0.0,
        )


__all__ = ["LiveCollector", "LiveSource", "LiveState", "ScrapeStart"]
