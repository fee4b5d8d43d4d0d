"""``kvxferd demo`` end to end (real daemons, real gRPC, real NIXL), its pure parts, and a
smoke run of ``kvxferd bench``.

The end-to-end tests run ``python -m kvxferd demo`` as a subprocess in a small configuration
and check its exit status and the JSON it writes: every request DONE, every pulled kernel
block verified, no failure, the refusal refused. The other tests check, without daemons, that
the request mix the demo generates is one the planner accepts for every preset, the block
allocators, the statistics and the argument parsing.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvxferd.blocks import plan_pull
from kvxferd.commands import demo
from kvxferd.layout import preset
from kvxferd.scenario import demo_pairs, demo_results
from kvxferd.scenario.mix import (
    CONTIGUOUS,
    FRAGMENTED,
    FULL_HIT,
    PREFIX_HIT,
    BlockAllocator,
    geometry,
    request_mix,
)
from kvxferd.scenario.report import Progress, percentile, table

REPO = Path(__file__).resolve().parents[2]
DEMO_TIMEOUT_S = 240


def _run_demo(tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "demo.json"
    cmd = [sys.executable, "-m", "kvxferd", "demo", "--quiet", "--json", str(out), *extra]
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, check=False
    )
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout}"
        f"\n--- stderr ---\n{proc.stderr}"
    )
    assert "result: OK" in proc.stdout
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


def _check_common(doc: dict[str, Any], requests: int) -> None:
    assert doc["ok"] is True and doc["failures"] == 0 and doc["errors"] == []
    assert doc["requests"] == requests == doc["requests_done"]
    per = doc["per_request"]
    assert len(per) == requests
    assert all(r["ok"] and r["state"] == "DONE" and not r["errors"] for r in per)
    # Every pulled kernel block verified, and the totals are the per-request sums.
    assert doc["requested_blocks"] > 0
    assert doc["verified_blocks"] == doc["requested_blocks"]
    assert doc["requested_blocks"] == sum(r["requested_blocks"] for r in per)
    assert all(r["verified_blocks"] == r["requested_blocks"] for r in per)
    # Bytes as planned, released by the prefill daemon once done.
    assert all(r["nbytes"] == r["planned_nbytes"] for r in per)
    assert all(r["released"] == "DONE" for r in per)
    assert doc["held_after"] == 0
    assert doc["bytes"] == sum(r["nbytes"] for r in per) > 0
    assert doc["descriptors"]["posted"] <= doc["descriptors"]["naive"]
    assert {r["pattern"] for r in per} == {CONTIGUOUS, FRAGMENTED}
    lat = doc["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    # The refused pair: ppl 34 vs 66 with prefix caching on, refused at the handshake.
    refusal = doc["refusal"]
    assert refusal["refused"] is True and refusal["code"] == "FAILED_PRECONDITION"
    assert "ppl" in refusal["message"] and refusal["error"] == ""


@pytest.mark.slow
def test_demo_dense_small(tmp_path: Path) -> None:
    doc = _run_demo(tmp_path, "--requests", "6", "--num-blocks", "64")
    _check_common(doc, 6)
    assert doc["preset"] == "dense" and doc["prefix_caching"] is True
    per = doc["per_request"]
    kinds = {r["kind"] for r in per}
    assert {PREFIX_HIT, FULL_HIT} <= kinds
    # A prefix hit asks fewer local blocks than the prefill holds; a full hit none at all.
    hit = next(r for r in per if r["kind"] == PREFIX_HIT)
    assert 0 < hit["local_blocks"][0] < hit["remote_blocks"][0]
    full = next(r for r in per if r["kind"] == FULL_HIT)
    assert full["local_blocks"] == [0] and full["remote_blocks"][0] > 0
    assert full["requested_blocks"] == 0 and full["nbytes"] == 0
    # Every block with data changed on the decode side (fresh pools, fresh blocks).
    assert doc["changed_blocks"] == doc["requested_blocks"]


@pytest.mark.slow
def test_demo_hybrid_different_ppl(tmp_path: Path) -> None:
    doc = _run_demo(tmp_path, "--preset", "hybrid", "--requests", "6", "--num-blocks", "16")
    _check_common(doc, 6)
    assert doc["prefix_caching"] is False
    assert "ppl=66" in doc["daemons"]["prefill"]["preset"]
    assert "ppl=34" in doc["daemons"]["decode"]["preset"]
    per = doc["per_request"]
    # Decode (ppl 34, 544-token blocks) lists about twice the prefill's (1056-token) blocks.
    assert any(r["local_blocks"][0] > r["remote_blocks"][0] for r in per)
    # One Mamba state per request on each side.
    assert all(r["local_blocks"][1] == r["remote_blocks"][1] == 1 for r in per)


@pytest.mark.slow
def test_demo_reports_a_daemon_that_fails_to_start(tmp_path: Path) -> None:
    """A daemon that exits at start-up fails the demo with its output's tail, no traceback."""
    out = tmp_path / "demo.json"
    env = {**os.environ, "KVXFERD_TRANSFER_MAX_INFLIGHT": "not-a-number"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvxferd", "demo", "--quiet", "--requests", "1", "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "exited with status 2" in proc.stdout
    assert "transfer.max_inflight" in proc.stdout  # the daemon's own error, from its log
    doc = json.loads(out.read_text())
    assert doc["ok"] is False and doc["failures"] >= 1 and doc["requests"] == 0


@pytest.mark.slow
def test_bench_smoke(tmp_path: Path) -> None:
    """``kvxferd bench`` at its smallest: one table row per pattern, every figure in JSON."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "kvxferd", "bench", "--sizes", "256", "--repeat", "1"]
    cmd += ["--latency-pulls", "3", "--strategy", "direct,auto", "--json", str(out)]
    cmd += ["--warmup", "2"]
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "small-request latency" in proc.stdout
    for row in ("raw copy (", "naive (1 desc per layer x block)", "floor (DIRECT's descs"):
        assert row in proc.stdout  # one table: raw, naive, floor, then kvxferd
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["error"] == ""
    assert doc["machine"]["cores"] >= 1 and doc["versions"]["torch"]
    assert doc["warmup"] == 2 and "after 2 untimed pulls of the size" in proc.stdout
    rows = {r["pattern"]: r for r in doc["rows"]}
    assert set(rows) == {CONTIGUOUS, FRAGMENTED}
    for r in rows.values():
        assert r["tokens"] == 256 and r["blocks"] == 16 and r["bytes"] == 32 * 16 * 65536
        assert r["limit"]["median_gbps"] > 0 and r["naive"]["median_gbps"] > 0
        assert r["kvxferd"]["median_gbps"] > 0 and r["mismatches"] == 0
        assert r["naive"]["descriptors"] == 32 * 16  # one per (layer, block)
        assert r["floor"]["median_gbps"] > 0 and r["floor"]["transport"]  # beside naive
        assert set(r["naive"]) <= set(r["floor"]) and r["kvxferd"]["transport"]
        assert r["kvxferd"]["descriptors_before_coalescing"] == 32 * 16
    assert rows[CONTIGUOUS]["kvxferd"]["descriptors_after_coalescing"] == 32  # one per layer
    assert rows[CONTIGUOUS]["floor"]["descriptors"] == 32  # what DIRECT posts
    lat = doc["latency"]
    assert lat["pulls"] == 3 and 0 < lat["p50_ms"] <= lat["p99_ms"]
    waited = lat["wait"]  # the same pulls answered by StartPull with wait
    assert len(waited["client_ms"]) == 3 and 0 < waited["p50_ms"] <= waited["p99_ms"]
    assert waited["stages_p50_ms"]["transfer"] > 0 and "StartPull with wait" in proc.stdout
    floor_ms = 32 * 16 * 65536 / (rows[FRAGMENTED]["floor"]["median_gbps"] * 1e9) * 1e3
    assert lat["floor_ms"] == pytest.approx(floor_ms)
    assert waited["added_p50_ms"] == pytest.approx(waited["p50_ms"] - floor_ms)
    on_socket = lat["socket"]  # the same pulls with wait on the scheduler socket
    assert len(on_socket["client_ms"]) == 3 and 0 < on_socket["p50_ms"] <= on_socket["p99_ms"]
    assert on_socket["added_p50_ms"] == pytest.approx(on_socket["p50_ms"] - floor_ms)
    assert "StartPull with wait (scheduler socket)" in proc.stdout
    # The control path's floor: one GetTransfer after each pull, the way the pull was asked
    # (gRPC after the watch and wait pulls, the socket after the socket's).
    rpc, sock_rpc = lat["rpc"], lat["socket_rpc"]
    assert len(rpc["ms"]) == 6 and 0 < rpc["p50_ms"] <= rpc["p99_ms"]
    assert len(sock_rpc["ms"]) == 3 and 0 < sock_rpc["p50_ms"] <= sock_rpc["p99_ms"]
    assert "control floor, gRPC: one GetTransfer round trip" in proc.stdout
    assert "control floor, scheduler socket: one GetTransfer round trip" in proc.stdout
    # Each pull's blocks released after it, as the prefill engine hears of it.
    rel = lat["release"]
    assert len(rel["ms"]) == 9 and 0 < rel["p50_ms"] <= rel["p99_ms"]
    assert "released after the pull" in proc.stdout
    # Every cell records the daemon's stages of each of its pulls.
    for r in rows.values():
        stages = r["strategy"]["stage_seconds"]
        assert {"decode", "plan", "confirm", "publish"} <= set(stages), stages


# ---- without daemons ------------------------------------------------------------------------


def _pairs() -> list[tuple[str, str, str, bool]]:
    out = []
    for name in demo_pairs.PRESET_NAMES:
        pair = demo_pairs.demo_pair(name, demo_pairs.DEFAULT_NUM_BLOCKS[name])
        out.append((name, pair.decode.preset, pair.prefill.preset, pair.prefix_caching))
    return out


@pytest.mark.parametrize(("name", "local_preset", "remote_preset", "prefix"), _pairs())
def test_every_generated_request_is_planned(
    name: str, local_preset: str, remote_preset: str, prefix: bool
) -> None:
    """The mix, placed by the allocators, is accepted by plan_pull for every preset."""
    local_spec, remote_spec = preset(local_preset), preset(remote_preset)
    lg, rg = geometry(local_spec), geometry(remote_spec)
    shapes = request_mix(16, local=lg, remote=rg, prefix_caching=prefix, seed=3)
    rng = np.random.default_rng(0)
    la = [BlockAllocator(g.num_logical_blocks, rng) for g in lg]
    ra = [BlockAllocator(g.num_logical_blocks, rng) for g in rg]
    kinds = set()
    for s in shapes:
        kinds.add(s.kind)
        remote = [a.take(n, s.pattern) for a, n in zip(ra, s.remote_counts(rg), strict=True)]
        local = [a.take(n, s.pattern) for a, n in zip(la, s.local_counts(lg, rg), strict=True)]
        assert all(x is not None for x in remote + local), f"{name}: {s} does not fit"
        plan = plan_pull(local_spec, remote_spec, local, remote, prefix_caching=prefix)
        blocks = sum(int(a.size) for a in plan.local_kernel_blocks)
        if s.full_hit:
            assert blocks == 0 and plan.empty
        else:
            assert blocks > 0
        for a, ids in [*zip(la, local, strict=True), *zip(ra, remote, strict=True)]:
            assert ids is not None
            a.release(ids)
    if prefix:
        assert {PREFIX_HIT, FULL_HIT} <= kinds
    else:
        assert PREFIX_HIT not in kinds and FULL_HIT not in kinds


def test_hybrid_kernel_counts_differ_by_less_than_one_logical_block() -> None:
    pair = demo_pairs.demo_pair("hybrid", 16)
    local_spec, remote_spec = preset(pair.decode.preset), preset(pair.prefill.preset)
    assert (local_spec.groups[0].ppl, remote_spec.groups[0].ppl) == (34, 66)
    lg, rg = geometry(local_spec), geometry(remote_spec)
    for s in request_mix(30, local=lg, remote=rg, prefix_caching=False, seed=1):
        k_l = s.local_counts(lg, rg)[0] * 34
        k_r = s.remote_counts(rg)[0] * 66
        assert abs(k_l - k_r) < 66 and min(k_l, k_r) * 16 >= s.tokens


def test_refusal_pair_differs_in_ppl_with_prefix_caching_on() -> None:
    pair = demo_pairs.refusal_pair()
    assert pair.prefill.prefix_caching and pair.decode.prefix_caching
    ppl = {preset(o.preset).groups[0].ppl for o in (pair.prefill, pair.decode)}
    assert ppl == {34, 66}


def test_allocator_contiguous_fragmented_and_lru() -> None:
    a = BlockAllocator(32, np.random.default_rng(0))
    run = a.take(8, CONTIGUOUS)
    assert run is not None and list(run) == list(range(8))
    frag = a.take(8, FRAGMENTED)
    assert frag is not None and len(set(frag.tolist())) == 8
    assert not set(frag.tolist()) & set(run.tolist())
    assert a.free_count == 16
    assert a.take(17, FRAGMENTED) is None and a.free_count == 16
    a.release(run)
    a.release(frag)
    # Never-used blocks go out before reused ones.
    used = set(run.tolist()) | set(frag.tolist())
    assert a.ever_used(sorted(used)) == 16
    fresh = a.take(16, FRAGMENTED)
    assert fresh is not None and not set(fresh.tolist()) & used
    a.release(fresh)
    with pytest.raises(ValueError):
        a.release(fresh)
    assert a.take(0, CONTIGUOUS) is not None


def test_allocator_finds_a_contiguous_run_between_holes() -> None:
    a = BlockAllocator(10, np.random.default_rng(0))
    first = a.take(4, CONTIGUOUS)
    second = a.take(4, CONTIGUOUS)
    assert first is not None and second is not None
    a.release(first)
    assert a.take(5, CONTIGUOUS) is None  # 4 free at 0..3, 2 at 8..9
    again = a.take(4, CONTIGUOUS)
    assert again is not None and list(again) == [0, 1, 2, 3]


def test_percentile_and_busy_time() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    # Overlapping pulls count once.
    assert demo_results.busy_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert demo_results.busy_seconds([]) == 0.0


def test_table_and_progress_lines() -> None:
    text = table(["kind", "n"], [["short", "1"], ["long", "10"]])
    assert text.splitlines()[0] == "kind    n"
    assert text.splitlines()[3] == "long   10"
    buf = io.StringIO()  # not a TTY: one line per step
    p = Progress.auto(2, quiet=False, stream=buf)
    assert p.mode == "lines"
    p.update(1, line="request 1 ok")
    p.finish()
    assert buf.getvalue() == "request 1 ok\n"
    quiet = io.StringIO()
    q = Progress.auto(2, quiet=True, stream=quiet)
    q.update(1, line="x")
    q.message("y")
    assert quiet.getvalue() == ""


def _run_json(tmp_path: Path, *args: str) -> tuple[str, dict[str, Any]]:
    """``python -m kvxferd ARGS --json FILE``, which must exit 0: its stdout and the JSON."""
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "kvxferd", *args, "--json", str(out)]
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc: dict[str, Any] = json.loads(out.read_text())
    return proc.stdout, doc


@pytest.mark.slow
def test_demo_tp_two_prefill_ranks_to_one_decode_rank(tmp_path: Path) -> None:
    """``--tp 2:1``: three daemons, the decode rank reads half its heads from each prefill rank,
    every block verified (docs/tp.md)."""
    stdout, doc = _run_json(tmp_path, "demo", "--tp", "2:1", "--requests", "2")
    assert "result: OK" in stdout
    assert doc["ok"] is True and (doc["prefill_tp"], doc["decode_tp"]) == (2, 1)
    (rank,) = doc["decode"]
    assert rank["blocks_checked"] > 0 and not rank["mismatches"]
    assert sorted({s for v in rank["sources"].values() for s in v}) == [0, 1]


@pytest.mark.slow
def test_bench_push_row_is_verified_and_says_what_ran(tmp_path: Path) -> None:
    """``--strategy push``: both daemons in transfer.mode = push, the sampled blocks verified,
    the row names PUSH and the NIXL WRITE."""
    args = ["--sizes", "256", "--repeat", "1", "--patterns", "fragmented", "--strategy", "push"]
    stdout, doc = _run_json(tmp_path, "bench", *args, "--latency-pulls", "2")
    assert "kvxferd push: PUSH" in stdout
    (row,) = doc["rows"]
    assert row["mismatches"] == 0 and row["kvxferd"]["median_gbps"] > 0
    assert row["strategy"] == {**row["strategy"], "configured": "push", "ran": "PUSH"}
    assert row["kvxferd"]["transport"].startswith("NIXL WRITE")


def test_arguments() -> None:
    parser = argparse.ArgumentParser()
    demo.add_parser(parser.add_subparsers())
    args = parser.parse_args(["demo"])
    assert (args.preset, args.requests, args.num_blocks, args.seed) == ("dense", 12, None, 0)
    args = parser.parse_args(["demo", "--preset", "hybrid", "--requests", "3", "--quiet"])
    assert (args.preset, args.requests, args.quiet) == ("hybrid", 3, True)
    assert parser.parse_args(["demo", "--tp", "4:1"]).tp == (4, 1)
    for bad in (
        ["--requests", "0"],
        ["--num-blocks", "4"],
        ["--preset", "nope"],
        ["--tp", "3:2"],
        ["--tp", "2"],
        ["--tp", "0:1"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(["demo", *bad])


def test_default_pools_stay_small() -> None:
    """Defaults must finish well under a minute on two cores: pools well under 4 GiB total."""
    for name in demo_pairs.PRESET_NAMES:
        pair = demo_pairs.demo_pair(name, demo_pairs.DEFAULT_NUM_BLOCKS[name])
        total = sum(preset(o.preset).nbytes for o in (pair.prefill, pair.decode))
        assert total <= 1.5 * (1 << 30), f"{name}: {total} bytes"
