"""Prometheus collectors, built against an injected registry (tests use their own).

Names follow Prometheus conventions (``_total`` counters, base units: bytes, seconds). Labels
stay low-cardinality: peers are labelled by address, never by request or transfer ID.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvxferd.staging.stats import StageTimes

_DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_DESC_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
_BYTES_BUCKETS = tuple(float(1 << s) for s in range(16, 36, 2))
_CHUNK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


@dataclass(frozen=True)
class Metrics:
    transfers: Counter
    transfer_bytes: Counter
    transfer_seconds: Histogram
    transfer_size_bytes: Histogram
    descriptors: Histogram
    naive_descriptors: Counter
    posted_descriptors: Counter
    inflight_transfers: Gauge
    inflight_bytes: Gauge
    peers: Gauge
    handshakes: Counter
    leases_active: Gauge
    lease_releases: Counter
    notifications: Counter
    pull_stage_seconds: Histogram
    rpc_errors: Counter
    registered_bytes: Gauge
    pool_generation: Gauge
    engine_detaches: Counter
    strategy_bytes: Counter
    staged_chunks: Histogram
    stage_seconds: Histogram

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

    @classmethod
    def create(cls, registry: CollectorRegistry) -> Metrics:
        r = registry
        return cls(
            transfers=Counter(
                "kvxferd_transfers",
                "Pulls that reached a terminal state.",
                ["state", "strategy"],
                registry=r,
            ),
            transfer_bytes=Counter(
                "kvxferd_transfer_bytes", "Bytes moved by completed pulls.", ["peer"], registry=r
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
                "Bytes per pull.",
                buckets=_BYTES_BUCKETS,
                registry=r,
            ),
            descriptors=Histogram(
                "kvxferd_transfer_descriptors",
                "Descriptors posted per pull after coalescing.",
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
            inflight_bytes=Gauge(
                "kvxferd_inflight_bytes", "Bytes of pulls in flight.", ["peer"], registry=r
            ),
            peers=Gauge("kvxferd_peers", "Known peers by handshake state.", ["state"], registry=r),
            handshakes=Counter(
                "kvxferd_handshakes",
                "Handshakes by side and result.",
                ["side", "result"],
                registry=r,
            ),
            leases_active=Gauge("kvxferd_leases_active", "Requests held for readers.", registry=r),
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
                buckets=(
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
                ),
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
                "gRPC calls that ended in an error.",
                ["method", "code"],
                registry=r,
            ),
            registered_bytes=Gauge(
                "kvxferd_registered_bytes", "KV memory registered with NIXL.", registry=r
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
                "Bytes moved by completed pulls, by strategy (DIRECT or STAGED).",
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
        )
