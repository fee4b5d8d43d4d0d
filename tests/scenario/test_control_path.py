"""kvxferd/scenario/control_path.py (bench/control_path.py's measurement): real daemons, pulls
on the scheduler socket, and the figures it reports (each daemon's CPU per pull, the stages,
the strategy that ran)."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest

from kvxferd.scenario import control_path
from kvxferd.v1 import scheduler_pb2


@pytest.mark.slow
def test_control_path_reports_cpu_per_pull_and_stages() -> None:
    # Enough pulls for each daemon's CPU time to pass several 10 ms clock ticks (/proc stat).
    fig = control_path.measure(control_path.TINY, "cpu", 60, 1, strategy="kernel")
    json.dumps(fig)  # what --json writes
    assert fig["pulls"] == 60 and fig["blocks"] == control_path.BLOCKS
    assert fig["strategies_seen"] == [scheduler_pb2.TRANSFER_STRATEGY_CMA]
    assert 0 < fig["p50_ms"] <= fig["p99_ms"]
    assert {"plan", "confirm", "transfer"} <= fig["stages_p50_ms"].keys()
    assert fig["cpu_ms_per_pull"]["decode"] > 0 and fig["cpu_ms_per_pull"]["prefill"] > 0


def test_the_pool_must_name_its_blocks() -> None:
    assert control_path.pool_blocks("dense:num_blocks=40,head_size=8") == 40
    with pytest.raises(SystemExit, match="num_blocks"):
        control_path.pool_blocks("dense:head_size=8")


def test_distinct_pulls_cycle_through_pairs_drawn_once() -> None:
    """--distinct K: pull k reads pair k mod K (local, remote), each a fresh draw of distinct
    IDs; without it every side of every pull is a new draw."""
    ids = control_path.id_source(np.random.default_rng(0), 40, 5, distinct=3)
    pulls = [(ids(), ids()) for _ in range(7)]
    for k, (local, remote) in enumerate(pulls):
        assert local.shape == remote.shape == (5,) and len(set(local.tolist())) == 5
        assert pulls[k % 3][0] is local and pulls[k % 3][1] is remote
    assert len({p[0].tobytes() for p in pulls[:3]} | {p[1].tobytes() for p in pulls[:3]}) == 6
    fresh = control_path.id_source(np.random.default_rng(0), 40, 5)
    assert len({fresh().tobytes() for _ in range(8)}) == 8


def test_a_pull_must_fit_in_the_pool() -> None:
    """Each pull draws that many distinct blocks on each side, before any daemon starts."""
    with pytest.raises(SystemExit, match="pick 1 to 80"):
        control_path.measure("dense:num_blocks=80", "cpu", 1, 0, strategy="kernel", n=81)


@pytest.mark.slow
def test_the_gap_leaves_the_daemons_idle_before_each_timed_pull() -> None:
    """``gap_s``: each timed pull comes that long after the one before (the wall covers the
    gaps), and every timed pull is listed in order."""
    fig = control_path.measure(control_path.TINY, "cpu", 8, 1, strategy="kernel", gap_s=0.05)
    assert fig["gap_s"] == 0.05 and len(fig["ms"]) == 8
    assert fig["wall_s"] >= 8 * 0.05
    assert statistics.median(fig["ms"]) == pytest.approx(fig["p50_ms"])  # the p50 is theirs
