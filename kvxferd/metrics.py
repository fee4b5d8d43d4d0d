"""Prometheus collectors, built against an injected registry (tests use their own).

Names follow Prometheus conventions (``_total`` counters, base units: bytes, seconds). Every
metric, its type, labels and buckets, and what to alert on: docs/operations.md (checked
against a live daemon by tests/ops).

Three kinds of series:

* event series (counters, histograms) updated where things happen; the label values an
  enum can take are created at zero up front (:data:`INITIAL_LABELS`), so a query over a
  daemon that never saw a failure returns 0 rather than nothing;
* live series (:class:`LiveCollector`): read from the daemon's state at each scrape (pulls
  by state, bytes in flight per peer, peer links, leases, staging ring occupancy), so they
  cannot drift from what the daemon holds;
* per-RPC series from :class:`RpcMetricsInterceptor` (server side) and
  :class:`PeerRpcMetricsInterceptor` (this daemon's calls to its peers).

Labels stay low-cardinality: never a request or transfer ID. The ``peer`` label (a peer's
address, a pod IP in Kubernetes) is bounded by :class:`PeerLabels`: a peer's series are
removed once it has been idle for ``idle_s`` (no pull, nothing in flight), and past
``max_peers`` distinct peers new ones are counted under ``peer="other"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import platform
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import Any, Generic, Protocol, TypeVar

import grpc
from grpc import aio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import gc_collector as _gc
from prometheus_client import metrics as _pc_metrics
from prometheus_client import platform_collector as _platform
from prometheus_client import process_collector as _process
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvxferd.staging.stats import Occupancy, StageTimes

_DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_DESC_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
_BYTES_BUCKETS = tuple(float(1 << s) for s in range(16, 36, 2))
_CHUNK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
_STAGE_BUCKETS = (
    10e-6,
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)
_RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)
# Per peer: few buckets (each is one series per peer).
_PEER_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.5, 2.5, 10)

TERMINAL_STATES = ("DONE", "FAILED", "CANCELLED", "EXPIRED")
ACTIVE_STATES = ("PENDING", "HANDSHAKING", "CONFIRMING", "TRANSFERRING")
"""Pulls not yet terminal: waiting (the first three: the peer's handshake, the lease
confirmation) or running (TRANSFERRING: READs posted)."""
LINK_STATES = ("NEW", "HANDSHAKING", "READY", "REFUSED", "UNREACHABLE", "STALE")
STRATEGIES = ("DIRECT", "STAGED", "KERNEL")
PULL_STAGES = ("handshake", "plan", "build", "confirm", "post", "transfer", "publish")
STAGED_STAGES = ("gather", "gather_rpc", "read", "scatter", "slot_wait")
RELEASE_REASONS = ("DONE", "EXPIRED", "CANCELLED", "ENGINE_DETACHED")
NOTIFICATION_RESULTS = ("counted", "stray", "undecodable")
DETACH_CAUSES = ("detach", "session", "no_session", "shutdown")
HANDSHAKE_RESULTS = {"client": ("ok", "refused", "failed"), "server": ("ok", "refused")}

OTHER_PEER = "other"


class PeerLabels:
    """Which peers get their own ``peer`` label value (thread-safe).

    A peer is tracked from its first pull; :meth:`expire` (called at each scrape) forgets
    peers idle for ``idle_s`` that have nothing in flight, and removes their series from
    every metric registered with :meth:`track`. At most ``max_peers`` are tracked at once;
    others are labelled ``other`` until room frees up."""

    def __init__(
        self,
        max_peers: int = 128,
        idle_s: float = 1800.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_peers = max_peers
        self.idle_s = idle_s
        self._clock = clock
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self._metrics: list[PeerMetric[Any]] = []

    def track(self, metric: PeerMetric[Any]) -> None:
        self._metrics.append(metric)

    def label(self, peer: str) -> str:
        """``peer`` if it has (or gets) its own series, else ``other``; marks it seen."""
        now = self._clock()
        with self._lock:
            if peer in self._seen or len(self._seen) < self.max_peers:
                self._seen[peer] = now
                return peer
        return OTHER_PEER

    def tracked(self) -> list[str]:
        with self._lock:
            return list(self._seen)

    def expire(self, busy: Iterable[str] = ()) -> list[str]:
        """Forget peers idle for ``idle_s`` (``busy`` ones are kept and marked seen) and
        remove their series; returns the peers forgotten."""
        now = self._clock()
        busy = set(busy)
        with self._lock:
            for peer in busy & self._seen.keys():
                self._seen[peer] = now
            gone = [p for p, t in self._seen.items() if p not in busy and now - t > self.idle_s]
            for peer in gone:
                del self._seen[peer]
        for peer in gone:
            for metric in self._metrics:
                metric.remove_peer(peer)
        return gone


M = TypeVar("M", Counter, Histogram, Gauge)


class PeerMetric(Generic[M]):
    """A metric whose first label is ``peer``, its values bounded by a :class:`PeerLabels`.

    ``.labels(peer, *rest)`` works like the metric's own ``labels``."""

    def __init__(self, metric: M, peers: PeerLabels) -> None:
        self.metric: M = metric
        self._peers = peers
        self._rest: set[tuple[str, ...]] = set()
        self._lock = threading.Lock()
        peers.track(self)

    def labels(self, peer: str, *rest: str) -> M:
        with self._lock:
            self._rest.add(rest)
        child: M = self.metric.labels(self._peers.label(peer), *rest)
        return child

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            rests = list(self._rest)
        for rest in rests:
            with contextlib.suppress(KeyError):
                self.metric.remove(peer, *rest)


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


class LiveSource(Protocol):
    def __call__(self) -> LiveState | None: ...


class _ScrapeStart(Collector):
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

    def __init__(self, start: _ScrapeStart, peers: PeerLabels) -> None:
        self._start = start
        self._peers = peers

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # no samples at registration time (the daemon may not exist yet)

    def collect(self) -> Iterator[GaugeMetricFamily]:
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


@dataclass(frozen=True)
class Metrics:
    transfers: Counter
    transfer_bytes: PeerMetric[Counter]
    transfer_seconds: Histogram
    transfer_size_bytes: Histogram
    descriptors: Histogram
    naive_descriptors: Counter
    posted_descriptors: Counter
    inflight_transfers: Gauge
    peers: Gauge  # not exported: kvxferd_peers comes from LiveCollector
    handshakes: Counter
    leases_active: Gauge  # not exported: kvxferd_leases_active comes from LiveCollector
    lease_releases: Counter
    notifications: Counter
    pull_stage_seconds: Histogram
    rpc_errors: Counter
    registered_bytes: Gauge
    staging_ring_bytes: Gauge
    pool_generation: Gauge
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
    scrape_start: _ScrapeStart

    def observe_strategy(self, strategy: str, nbytes: int, times: StageTimes | None) -> None:
        """A completed pull's bytes by strategy; for STAGED, its chunks and stage times."""
        self.strategy_bytes.labels(strategy).inc(nbytes)
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
        start = _ScrapeStart(peers)
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
                buckets=_DURATION_BUCKETS,
                registry=r,
            ),
            transfer_size_bytes=Histogram(
                "kvxferd_transfer_size_bytes",
                "Bytes per completed pull.",
                buckets=_BYTES_BUCKETS,
                registry=r,
            ),
            descriptors=Histogram(
                "kvxferd_transfer_descriptors",
                "Descriptors posted per completed pull after coalescing.",
                buckets=_DESC_BUCKETS,
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
            inflight_transfers=Gauge(
                "kvxferd_inflight_transfers", "Pulls not yet terminal.", registry=r
            ),
            peers=Gauge(
                "kvxferd_peers", "(superseded by the live series)", ["state"], registry=None
            ),
            handshakes=Counter(
                "kvxferd_handshakes",
                "Handshakes by side (client: this daemon reading; server: a reader asking)"
                " and result.",
                ["side", "result"],
                registry=r,
            ),
            leases_active=Gauge(
                "kvxferd_leases_active", "(superseded by the live series)", registry=None
            ),
            lease_releases=Counter(
                "kvxferd_lease_releases",
                "Held requests released, by reason.",
                ["reason"],
                registry=r,
            ),
            pull_stage_seconds=Histogram(
                "kvxferd_pull_stage_seconds",
                "Where a pull's time went, per stage: handshake (wait for a ready peer), plan,"
                " build (descriptors), confirm (lease confirmation not hidden behind planning),"
                " post (queue to the NIXL thread + post), transfer (post to completion seen;"
                " STAGED: all chunks), publish (completion seen to status published).",
                ["stage"],
                buckets=_STAGE_BUCKETS,
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
            registered_bytes=Gauge(
                "kvxferd_registered_bytes",
                "KV pool memory registered with NIXL (the staging ring is"
                " kvxferd_staging_ring_bytes).",
                registry=r,
            ),
            staging_ring_bytes=Gauge(
                "kvxferd_staging_ring_bytes",
                "Staging ring memory registered with NIXL (0: staging disabled).",
                registry=r,
            ),
            pool_generation=Gauge(
                "kvxferd_pool_generation",
                "Registration generation of the pool (bumped on every attach and detach).",
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
                buckets=_CHUNK_BUCKETS,
                registry=r,
            ),
            stage_seconds=Histogram(
                "kvxferd_staged_stage_seconds",
                "Seconds per completed STAGED pull spent in each stage, summed over its chunks.",
                ["stage"],
                buckets=_DURATION_BUCKETS,
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
                buckets=_RPC_BUCKETS,
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
                buckets=_RPC_BUCKETS,
                registry=r,
            ),
            handshake_seconds=Histogram(
                "kvxferd_handshake_duration_seconds",
                "Handshake latency: client (this daemon's call to a peer, round trip) and"
                " server (answering a reader).",
                ["side"],
                buckets=_RPC_BUCKETS,
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
                    buckets=_PEER_BUCKETS,
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


# --- per-RPC metrics ------------------------------------------------------------------------


def code_name(code: object) -> str:
    """A status code as its name (``OK``, ``NOT_FOUND``), whatever form grpc returned it in."""
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        for c in grpc.StatusCode:
            if c.value[0] == code:
                return c.name
    return "UNKNOWN"


def split_method(full: str) -> tuple[str, str]:
    """``/kvxferd.v1.Peer/Handshake`` -> (``kvxferd.v1.Peer``, ``Handshake``)."""
    service, _, method = full.lstrip("/").rpartition("/")
    return service, method


_Behavior = Callable[..., Any]


class RpcMetricsInterceptor(aio.ServerInterceptor):  # type: ignore[type-arg]
    """Counts every call a server answers (``kvxferd_rpcs_total``) and times unary answers
    (``kvxferd_rpc_duration_seconds``). Put it first in the server's interceptors: it then
    also counts calls the later ones refuse (UNAUTHENTICATED, INVALID_ARGUMENT).

    Only methods in ``known`` get their own label values (a caller picks the method name);
    the rest are counted as ``service="unknown"``."""

    def __init__(self, metrics: Metrics, known: Iterable[str]) -> None:
        self._m = metrics
        self._known = frozenset(known)
        self._cache: dict[str, tuple[grpc.RpcMethodHandler[Any, Any], Any]] = {}
        # The codes alerts select exist at 0 from the start (KvxferdRpcInternalErrors,
        # KvxferdBackPressure): a quiet daemon answers those queries with 0, not nothing.
        for full in sorted(self._known):
            service, method = split_method(full)
            if service.startswith("kvxferd."):
                metrics.rpcs.labels(service, method, "INTERNAL")
                if method == "StartPull":
                    metrics.rpcs.labels(service, method, "RESOURCE_EXHAUSTED")

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(details)
        if handler is None:
            return handler
        full: str = details.method
        cached = self._cache.get(full)
        if cached is not None and cached[0] is handler:
            return cached[1]  # type: ignore[no-any-return]
        service, method = split_method(full) if full in self._known else ("unknown", "unknown")
        wrapped = self._wrap(handler, service, method)
        if full in self._known:
            self._cache[full] = (handler, wrapped)
        return wrapped

    def _done(self, service: str, method: str, code: str, t0: float | None) -> None:
        self._m.rpcs.labels(service, method, code).inc()
        if t0 is not None:
            seconds = time.perf_counter() - t0
            self._m.rpc_seconds.labels(service, method).observe(seconds)
            if service == "kvxferd.v1.Peer" and method == "Handshake":
                self._m.handshake_seconds.labels("server").observe(seconds)

    def _wrap(
        self, handler: grpc.RpcMethodHandler[Any, Any], service: str, method: str
    ) -> grpc.RpcMethodHandler[Any, Any]:
        behavior: _Behavior | None = (
            handler.stream_stream
            or handler.stream_unary
            or handler.unary_stream
            or handler.unary_unary
        )
        if behavior is None:
            return handler
        timed = not handler.response_streaming
        done = self._done
        wrapped: _Behavior
        if inspect.isasyncgenfunction(behavior):
            gen_behavior = behavior

            async def generator(request: Any, context: Any) -> AsyncIterator[Any]:
                t0 = time.perf_counter() if timed else None
                code = "UNKNOWN"
                try:
                    async for response in gen_behavior(request, context):
                        yield response
                    code = _final_code(context, "OK")
                except BaseException as exc:
                    code = _final_code(context, _exc_code(exc))
                    raise
                finally:
                    done(service, method, code, t0)

            wrapped = generator
        elif inspect.iscoroutinefunction(behavior):
            co_behavior = behavior

            async def coroutine(request: Any, context: Any) -> Any:
                t0 = time.perf_counter() if timed else None
                code = "UNKNOWN"
                try:
                    response = await co_behavior(request, context)
                    code = _final_code(context, "OK")
                    return response
                except BaseException as exc:
                    code = _final_code(context, _exc_code(exc))
                    raise
                finally:
                    done(service, method, code, t0)

            wrapped = coroutine
        else:
            return handler  # a synchronous behaviour (none of ours): left uncounted
        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return factory(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _exc_code(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    return "UNKNOWN"


def _final_code(context: Any, default: str) -> str:
    """The code the servicer set (``set_code`` or ``abort``), else ``default``."""
    try:
        code = context.code()
    except Exception:
        return default
    if code is None:
        return default
    name = code_name(code)
    return default if name == "OK" and default != "OK" else name


class PeerRpcMetricsInterceptor(aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    """On the channels a daemon opens to its peers: counts and times each Peer call
    (``kvxferd_peer_rpcs_total``, ``kvxferd_peer_rpc_duration_seconds``; Handshake also in
    ``kvxferd_handshake_duration_seconds{side="client"}``)."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics
        self._methods: dict[str, str] = {}

    async def intercept_unary_unary(
        self,
        continuation: Callable[[Any, Any], Awaitable[Any]],
        client_call_details: aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        t0 = time.perf_counter()
        call = await continuation(client_call_details, request)
        raw = client_call_details.method
        full = raw.decode() if isinstance(raw, bytes) else str(raw)
        service, method = split_method(full)
        if service != "kvxferd.v1.Peer":
            method = "other"
        code = "UNKNOWN"
        try:
            await call
            code = "OK"
        except aio.AioRpcError as exc:
            code = code_name(exc.code())
        except BaseException as exc:
            code = _exc_code(exc)
            raise
        finally:
            seconds = time.perf_counter() - t0
            self._m.peer_rpcs.labels(method, code).inc()
            self._m.peer_rpc_seconds.labels(method).observe(seconds)
            if method == "Handshake":
                self._m.handshake_seconds.labels("client").observe(seconds)
        return call


__all__ = [
    "LiveCollector",
    "LiveState",
    "Metrics",
    "PeerLabels",
    "PeerMetric",
    "PeerRpcMetricsInterceptor",
    "RpcMetricsInterceptor",
]
