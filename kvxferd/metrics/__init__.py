"""Prometheus collectors, built against an injected registry (tests use their own).

Names follow Prometheus conventions (``_total`` counters, base units: bytes, seconds). Every
metric, its type, labels and buckets, and what to alert on: docs/operations.md (checked
against a live daemon by tests/ops).

Three kinds of series, one module each:

* event series (counters, histograms; :mod:`~kvxferd.metrics.series`) updated where things
  happen; the label values an enum can take (:mod:`~kvxferd.metrics.values`) are created at
  zero up front, so a query over a daemon that never saw a failure returns 0 rather than
  nothing;
* live series (:mod:`~kvxferd.metrics.live`): read from the daemon's state at each scrape
  (pulls by state, bytes in flight per peer, peer links, leases, staging ring occupancy), so
  they cannot drift from what the daemon holds;
* per-RPC series (:mod:`~kvxferd.metrics.rpc`) from :class:`RpcMetricsInterceptor` (server
  side) and :class:`PeerRpcMetricsInterceptor` (this daemon's calls to its peers).

Labels stay low-cardinality: never a request or transfer ID. The ``peer`` label (a peer's
address, a pod IP in Kubernetes) is bounded by :class:`PeerLabels`: a peer's series are
removed once it has been idle for ``idle_s`` (no pull, nothing in flight), and past
``max_peers`` distinct peers new ones are counted under ``peer="other"``.
"""

from kvxferd.metrics.live import LiveCollector, LiveSource, LiveState, ScrapeStart
from kvxferd.metrics.peer_labels import OTHER_PEER, PeerLabels, PeerMetric
from kvxferd.metrics.rpc import (
    MeteredTransport,
    PeerRpcMetricsInterceptor,
    RpcMetricsInterceptor,
    code_name,
    split_method,
)
from kvxferd.metrics.series import Metrics, build_labels
from kvxferd.metrics.values import (
    ACTIVE_STATES,
    DETACH_CAUSES,
    HANDSHAKE_RESULTS,
    LINK_STATES,
    NOTIFICATION_RESULTS,
    PULL_STAGES,
    RELEASE_REASONS,
    STAGED_STAGES,
    STRATEGIES,
    TERMINAL_STATES,
)

__all__ = [
    "ACTIVE_STATES",
    "DETACH_CAUSES",
    "HANDSHAKE_RESULTS",
    "LINK_STATES",
    "NOTIFICATION_RESULTS",
    "OTHER_PEER",
    "PULL_STAGES",
    "RELEASE_REASONS",
    "STAGED_STAGES",
    "STRATEGIES",
    "TERMINAL_STATES",
    "LiveCollector",
    "LiveSource",
    "LiveState",
    "MeteredTransport",
    "Metrics",
    "PeerLabels",
    "PeerMetric",
    "PeerRpcMetricsInterceptor",
    "RpcMetricsInterceptor",
    "ScrapeStart",
    "build_labels",
    "code_name",
    "split_method",
]
