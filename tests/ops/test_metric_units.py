"""Units of kvxferd.metrics: the bounded ``peer`` label and the live collector's fallbacks."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvxferd.metrics import OTHER_PEER, LiveState, Metrics, PeerLabels, code_name, split_method


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _text(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_idle_peers_are_forgotten_and_their_series_removed() -> None:
    clock = Clock()
    registry = CollectorRegistry()
    m = Metrics.create(registry, process=False, peer_labels=PeerLabels(idle_s=60, clock=clock))
    m.add_live(lambda: LiveState(inflight_bytes={"10.0.0.2:1": 4096}))
    m.transfer_bytes.labels("10.0.0.1:1").inc(10)
    m.observe_pull_end("10.0.0.1:1", "DONE", 0.2)
    m.observe_pull_end("10.0.0.2:1", "FAILED", 0.2)
    assert 'peer="10.0.0.1:1"' in _text(registry)
    clock.now = 61
    text = _text(registry)  # a scrape expires idle peers first
    assert 'peer="10.0.0.1:1"' not in text
    # 10.0.0.2 has bytes in flight: kept, however old its last pull.
    assert 'kvxferd_inflight_bytes{peer="10.0.0.2:1"} 4096.0' in text
    assert 'kvxferd_peer_pulls_total{peer="10.0.0.2:1",state="FAILED"} 1.0' in text
    # A peer that comes back starts from zero.
    m.transfer_bytes.labels("10.0.0.1:1").inc(1)
    assert 'kvxferd_transfer_bytes_total{peer="10.0.0.1:1"} 1.0' in _text(registry)


def test_peers_beyond_the_cap_share_the_other_label() -> None:
    registry = CollectorRegistry()
    m = Metrics.create(registry, process=False, peer_labels=PeerLabels(max_peers=2))
    for i in range(5):
        m.transfer_bytes.labels(f"p{i}:1").inc(1)
    text = _text(registry)
    assert 'peer="p0:1"' in text and 'peer="p1:1"' in text and 'peer="p2:1"' not in text
    assert f'kvxferd_transfer_bytes_total{{peer="{OTHER_PEER}"}} 3.0' in text


def test_live_series_are_left_out_when_the_daemon_does_not_answer() -> None:
    registry = CollectorRegistry()
    m = Metrics.create(registry, process=False)
    m.add_live(lambda: None)
    text = _text(registry)
    assert "kvxferd_pulls" not in text and "kvxferd_build_info{" in text


def test_enum_series_exist_at_zero_and_no_created_series() -> None:
    registry = CollectorRegistry()
    Metrics.create(registry)
    text = _text(registry)
    assert 'kvxferd_transfers_total{state="EXPIRED",strategy="STAGED"} 0.0' in text
    assert 'kvxferd_lease_releases_total{reason="EXPIRED"} 0.0' in text
    assert 'kvxferd_pull_stage_seconds_count{stage="post"} 0.0' in text
    assert "_created" not in text
    assert "process_cpu_seconds_total" in text


def test_helpers() -> None:
    assert split_method("/kvxferd.v1.Peer/Handshake") == ("kvxferd.v1.Peer", "Handshake")
    assert code_name(5) == "NOT_FOUND" and code_name(None) == "UNKNOWN"


def test_every_kvxferd_gauge_is_read_from_live_state_at_scrape_time() -> None:
    """No gauge is a mirror set in code paths: without a live source only build_info is a
    kvxferd gauge, and with one each live gauge follows the source from scrape to scrape."""
    registry = CollectorRegistry()
    m = Metrics.create(registry, process=False)
    mirrored = [
        f.name
        for f in registry.collect()
        if f.type == "gauge" and f.name.startswith("kvxferd_") and f.name != "kvxferd_build_info"
    ]
    assert mirrored == [], f"gauges set in code paths instead of read live: {mirrored}"

    state = LiveState()
    m.add_live(lambda: state)
    text = _text(registry)
    for family in (
        "kvxferd_inflight_transfers",
        "kvxferd_registered_bytes",
        "kvxferd_staging_ring_bytes",
        "kvxferd_pool_generation",
        "kvxferd_leases_active",
    ):
        assert f"{family} 0.0" in text, family
    state = LiveState(
        pulls={"PENDING": 2, "TRANSFERRING": 3},
        leases=4,
        registered_bytes=4096,
        staging_ring_bytes=512,
        pool_generation=7,
    )
    text = _text(registry)
    assert "kvxferd_inflight_transfers 5.0" in text
    assert 'kvxferd_pulls{state="TRANSFERRING"} 3.0' in text
    assert "kvxferd_leases_active 4.0" in text
    assert "kvxferd_registered_bytes 4096.0" in text
    assert "kvxferd_staging_ring_bytes 512.0" in text
    assert "kvxferd_pool_generation 7.0" in text


def test_a_series_child_is_looked_up_once_and_counts_in_the_registry() -> None:
    """Metrics.child (the hot paths' labels): the very child ``labels`` gives, found once per
    label set and metric, and what it counts is what a scrape shows."""
    registry = CollectorRegistry()
    m = Metrics.create(registry, process=False)
    done = m.child(m.transfers, "DONE", "KERNEL")
    assert done is m.transfers.labels("DONE", "KERNEL") is m.child(m.transfers, "DONE", "KERNEL")
    assert m.child(m.transfers, "FAILED", "KERNEL") is not done
    assert m.child(m.peer_rpcs, "DONE", "KERNEL") is not done  # another metric, same values
    done.inc(2)
    m.child(m.peer_rpc_seconds, "ConfirmLease").observe(0.001)
    text = _text(registry)
    assert 'kvxferd_transfers_total{state="DONE",strategy="KERNEL"} 2.0' in text
    assert 'kvxferd_peer_rpc_duration_seconds_count{method="ConfirmLease"} 1.0' in text
