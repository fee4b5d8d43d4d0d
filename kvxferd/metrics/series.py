"""The event series (counters and histograms updated where things happen) in one
:class:`Metrics` value, built against an injected registry (tests use their own)."""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import Any, TypeVar, cast

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import gc_collector as _gc
from prometheus_client import metrics as _pc_metrics
from prometheus_client import platform_collector as _platform
from prometheus_client import process_collector as _process

from kvxferd.metrics.live import LiveCollector, LiveSource, ScrapeStart
from kvxferd.metrics.peer_labels import PeerLabels, PeerMetric
from kvxferd.metrics.values import (
    BYTES_BUCKETS,
    CHUNK_BUCKETS,
    DESC_BUCKETS,
    DETACH_CAUSES,
    DURATION_BUCKETS,
    HANDSHAKE_RESULTS,
    NOTIFICATION_RESULTS,
    PEER_BUCKETS,
    PULL_STAGES,
    RELEASE_REASONS,
    RPC_BUCKETS,
    STAGE_BUCKETS,
    STAGED_STAGES,
    STRATEGIES,
    TERMINAL_STATES,
)
from kvxferd.staging.stats import StageTimes

M = TypeVar("M", Counter, Histogram)


@dataclass(frozen=True)
class Metrics:
    transfers: Counter
    transfer_bytes: PeerMetric[Counter]
    transfer_seconds: Histogram
    transfer_size_bytes: Histogram
    descriptors: Histogram
    naive_descriptors: Counter
    posted_descriptors: Counter
    handshakes: Counter
    lease_releases: Counter
    lease_read_seconds: Histogram
    notifications: Counter
    pull_stage_seconds: Histogram
    rpc_errors: Counter
    engine_detaches: Counter
    strategy_bytes: Counter
    staged_chunks: Histogram
    stage_seconds: Histogram
    rpcs: Counter
    rpc_seconds: Histogram
    peer_rpcs: Counter
    peer_rpc_seconds: Histogram
    handshake_seconds: Histogram
    peer_pulls: PeerMetric[Counter]
    peer_pull_seconds: PeerMetric[Histogram]
    build_info: Gauge
    peer_labels: PeerLabels
    registry: CollectorRegistry
    scrape_start: ScrapeStart
    _children: dict[tuple[int, tuple[str, ...]], Any] = field(
        default_factory=dict, repr=False, compare=False
    )

    def child(self, metric: M, *values: str) -> M:
        """``metric.labels(*values)``, looked up once per label set: prometheus_client checks
        and locks on every ``labels`` call, and a pull updates a dozen series. Only for the
        series here whose children are never removed (not the per-peer ones)."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return cast(M, found)

    def observe_strategy(self, strategy: str, nbytes: int, times: StageTimes | None) -> None:
        """A completed pull's bytes by strategy; for STAGED, its chunks and stage times."""
        self.child(self.strategy_bytes, strategy).inc(nbytes)
        if times is None:
            return
        self.staged_chunks.observe(times.chunks)
        for stage, seconds in (
            ("gather", times.gather_s),
            ("gather_rpc", times.gather_rpc_s),
            ("read", times.read_s),
            ("scatter", times.scatter_s),
            ("slot_wait", times.slot_wait_s),
        ):
            self.stage_seconds.labels(stage).observe(seconds)
        if times.stream:  # a Gather per chunk has no stream control stages
            for stage, seconds in (
                ("control", times.control_s),
                ("owner_start", times.owner_start_s),
                ("owner_slot_wait", times.owner_slot_wait_s),
            ):
                self.stage_seconds.labels(stage).observe(seconds)

    def observe_pull_end(self, peer: str, state: str, seconds: float) -> None:
        """A pull reached ``state`` (terminal) after ``seconds``: the per-peer series."""
        self.peer_pulls.labels(peer, state).inc()
        self.peer_pull_seconds.labels(peer).observe(seconds)

    def add_live(self, source: LiveSource) -> LiveCollector:
        """Register the live series, read from ``source`` at each scrape."""
        self.scrape_start.source = source
        collector = LiveCollector(self.scrape_start, self.peer_labels)
        self.registry.register(collector)
        return collector

    @classmethod
    def create(
        cls,
        registry: CollectorRegistry,
        *,
        process: bool = True,
        peer_labels: PeerLabels | None = None,
    ) -> Metrics:
        """Every event series in ``registry``; with ``process``, also the standard
        ``process_*`` and ``python_*`` series of this process."""
        r = registry
        # No ``*_created`` series (one per labelled child): they double the series count.
        disable_created: Callable[[], None] = _pc_metrics.disable_created_metrics
        disable_created()
        peers = peer_labels or PeerLabels()
        start = ScrapeStart(peers)
        r.register(start)
        m = cls(
            transfers=Counter(
                "kvxferd_transfers",
                "Pulls that reached a terminal state.",
                ["state", "strategy"],
                registry=r,
            ),
            transfer_bytes=PeerMetric(
                Counter(
                    "kvxferd_transfer_bytes",
                    "Bytes moved by completed pulls, per peer.",
                    ["peer"],
                    registry=r,
                ),
                peers,
            ),
            transfer_seconds=Histogram(
                "kvxferd_transfer_duration_seconds",
                "From a pull's start to its terminal state.",
                ["state"],
                buckets=DURATION_BUCKETS,
                registry=r,
            ),
            transfer_size_bytes=Histogram(
                "kvxferd_transfer_size_bytes",
                "Bytes per completed pull.",
                buckets=BYTES_BUCKETS,
                registry=r,
            ),
            descriptors=Histogram(
                "kvxferd_transfer_descriptors",
                "Descriptors posted per completed pull after coalescing.",
                buckets=DESC_BUCKETS,
                registry=r,
            ),
            naive_descriptors=Counter(
                "kvxferd_naive_descriptors",
                "Descriptors one-per-(region, kernel block) would have posted.",
                registry=r,
            ),
            posted_descriptors=Counter(
                "kvxferd_posted_descriptors", "Descriptors actually posted.", registry=r
            ),
            handshakes=Counter(
                "kvxferd_handshakes",
                "Handshakes by side (client: this daemon reading; server: a reader asking)"
                " and result.",
                ["side", "result"],
                registry=r,
            ),
            lease_releases=Counter(
                "kvxferd_lease_releases",
                "Held requests released, by reason.",
                ["reason"],
                registry=r,
            ),
            lease_read_seconds=Histogram(
                "kvxferd_lease_read_seconds",
                "Owner side: from a reader's lease confirmation to its READ_DONE counted (its copy"
                " and the notification's way back): how long one read holds the blocks.",
                buckets=RPC_BUCKETS,
                registry=r,
            ),
            pull_stage_seconds=Histogram(
                "kvxferd_pull_stage_seconds",
                "Where a pull's time went, per stage: decode (StartPull handler to request"
                " checked), handshake (wait for a ready peer), plan, build (DIRECT's descriptors,"
                " KERNEL's checked pieces and launch tables), confirm"
                " (lease confirmation not hidden behind planning), post (queue to the NIXL thread"
                " + post), transfer (post to completion seen; STAGED: all chunks), publish"
                " (completion seen to status published), notify (status published to a"
                " WatchTransfers message handed to gRPC, per watcher).",
                ["stage"],
                buckets=STAGE_BUCKETS,
                registry=r,
            ),
            notifications=Counter(
                "kvxferd_notifications",
                "READ_DONE notifications received, by result: counted (a confirmed reader's"
                " ticket), stray (no share of that ticket is reading: ignored), undecodable.",
                ["result"],
                registry=r,
            ),
            rpc_errors=Counter(
                "kvxferd_rpc_errors",
                "gRPC calls that ended in an error, as the servicer answered them.",
                ["method", "code"],
                registry=r,
            ),
            engine_detaches=Counter(
                "kvxferd_engine_detaches",
                "Engine pools detached, by cause (detach, session, no_session, shutdown).",
                ["cause"],
                registry=r,
            ),
            strategy_bytes=Counter(
                "kvxferd_strategy_bytes",
                "Bytes moved by completed pulls, by strategy (DIRECT, STAGED or KERNEL).",
                ["strategy"],
                registry=r,
            ),
            staged_chunks=Histogram(
                "kvxferd_staged_chunks",
                "Chunks per completed STAGED pull.",
                buckets=CHUNK_BUCKETS,
                registry=r,
            ),
            stage_seconds=Histogram(
                "kvxferd_staged_stage_seconds",
                "Seconds per completed STAGED pull spent in each stage, summed over its chunks.",
                ["stage"],
                buckets=DURATION_BUCKETS,
                registry=r,
            ),
            rpcs=Counter(
                "kvxferd_rpcs",
                "gRPC calls this daemon served, by service, method and status code.",
                ["service", "method", "code"],
                registry=r,
            ),
            rpc_seconds=Histogram(
                "kvxferd_rpc_duration_seconds",
                "Time to answer a unary gRPC call this daemon served (streams: not observed).",
                ["service", "method"],
                buckets=RPC_BUCKETS,
                registry=r,
            ),
            peer_rpcs=Counter(
                "kvxferd_peer_rpcs",
                "Calls this daemon made to its peers' Peer service, by method and status code.",
                ["method", "code"],
                registry=r,
            ),
            peer_rpc_seconds=Histogram(
                "kvxferd_peer_rpc_duration_seconds",
                "Round trip of a call to a peer's Peer service.",
                ["method"],
                buckets=RPC_BUCKETS,
                registry=r,
            ),
            handshake_seconds=Histogram(
                "kvxferd_handshake_duration_seconds",
                "Handshake latency: client (this daemon's call to a peer, round trip) and"
                " server (answering a reader).",
                ["side"],
                buckets=RPC_BUCKETS,
                registry=r,
            ),
            peer_pulls=PeerMetric(
                Counter(
                    "kvxferd_peer_pulls",
                    "Pulls that reached a terminal state, per peer and state.",
                    ["peer", "state"],
                    registry=r,
                ),
                peers,
            ),
            peer_pull_seconds=PeerMetric(
                Histogram(
                    "kvxferd_peer_pull_duration_seconds",
                    "From a pull's start to its terminal state (any state), per peer.",
                    ["peer"],
                    buckets=PEER_BUCKETS,
                    registry=r,
                ),
                peers,
            ),
            build_info=Gauge(
                "kvxferd_build_info",
                "Always 1; the labels carry the versions of kvxferd and what it runs on.",
                ["version", "python", "grpcio", "protobuf", "nixl"],
                registry=r,
            ),
            peer_labels=peers,
            registry=r,
            scrape_start=start,
        )
        m._initialise()
        if process:
            _process.ProcessCollector(registry=r)
            _platform.PlatformCollector(registry=r)
            _gc.GCCollector(registry=r)
        return m

    def _initialise(self) -> None:
        """Zero series for every label value an enum can take, and build_info."""
        for state in TERMINAL_STATES:
            self.transfer_seconds.labels(state)
            for strategy in STRATEGIES:
                self.transfers.labels(state, strategy)
        for strategy in STRATEGIES:
            self.strategy_bytes.labels(strategy)
        for stage in PULL_STAGES:
            self.pull_stage_seconds.labels(stage)
        for stage in STAGED_STAGES:
            self.stage_seconds.labels(stage)
        for reason in RELEASE_REASONS:
            self.lease_releases.labels(reason)
        for result in NOTIFICATION_RESULTS:
            self.notifications.labels(result)
        for cause in DETACH_CAUSES:
            self.engine_detaches.labels(cause)
        for side, results in HANDSHAKE_RESULTS.items():
            self.handshake_seconds.labels(side)
            for result in results:
                self.handshakes.labels(side, result)
        self.build_info.labels(**build_labels()).set(1)


def _dist_version(*names: str) -> str:
    for name in names:
        try:
            return importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            continue
    return ""


def build_labels() -> dict[str, str]:
    """kvxferd's version and its runtime's (without importing NIXL)."""
    from kvxferd import __version__

    nixl = _dist_version("nixl-cu13", "nixl-cu12", "nixl")
    return {
        "version": __version__,
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "protobuf": _dist_version("protobuf"),
        "nixl": nixl or "none",
    }


__all__ = ["Metrics", "build_labels"]
