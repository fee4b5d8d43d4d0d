"""The bounded ``peer`` label: which peers get their own series, and forgetting idle ones.

A peer's address (a pod IP in Kubernetes) is an unbounded label value. :class:`PeerLabels`
tracks peers from their first pull, removes an idle peer's series, and past ``max_peers``
labels new peers ``other``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from prometheus_client import Counter, Gauge, Histogram

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


__all__ = ["OTHER_PEER", "PeerLabels", "PeerMetric"]
