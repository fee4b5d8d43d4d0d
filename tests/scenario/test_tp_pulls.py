"""Heterogeneous TP with one real daemon per rank (docs/tp.md): every decode rank ends up with
every head of every block it needs, bytes verified by Checksum; refusals carry their reasons.

Each ``run_tp`` starts its own daemons (P prefill + D decode processes, NIXL over UCX, gRPC on
127.0.0.1:0), so each shape and preset runs once per module and the tests read its report.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvxferd.blocks.tp import kv_head_range
from kvxferd.client import AsyncSchedulerClient, SchedulerClient, TransferState
from kvxferd.client.ranks import (
    RankedPull,
    RankHold,
    TPModel,
    hold_readers,
    pull_from_ranks,
    pull_from_ranks_async,
    ranks_to_pull,
)
from kvxferd.layout.spec import KVCacheSpec
from kvxferd.scenario.client import DaemonClient, ReleaseWatcher
from kvxferd.scenario.daemons import DaemonOptions, DaemonSet
from kvxferd.scenario.tp import TPReport, run_tp
from kvxferd.scenario.tp_bytes import group_digests, region_blocks
from kvxferd.scenario.tp_plan import kernel_ids, make_requests, rank_spec
from kvxferd.scenario.tp_pool import AttachedPool

SHAPES = ((2, 1), (1, 2), (4, 1))
PRESETS = ("dense", "mla", "hybrid")
MODELS = {
    "dense": TPModel(kv_heads=8),
    "mla": TPModel(mla=True),
    "hybrid": TPModel(kv_heads=2, state=True),
}
REQUESTS = 2
# The hybrid prefill side allocates logical blocks of 34 kernel blocks, the decode side of 66
# (the page size follows the TP size in such models): the Nemotron-style 4P1D pairing.
PREFILL_OPTIONS = {"hybrid": "ppl=34"}


@pytest.fixture(
    scope="module",
    params=[(p, d, s) for p, d in SHAPES for s in PRESETS],
    ids=lambda x: f"{x[0]}to{x[1]}-{x[2]}",
)
def report(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TPReport:
    p, d, preset = request.param
    return run_tp(
        p,
        d,
        preset,
        requests=REQUESTS,
        prefill_options=PREFILL_OPTIONS.get(preset, ""),
        workdir=tmp_path_factory.mktemp("tp"),
    )


def _filled(report: TPReport) -> tuple[KVCacheSpec, list[int]]:
    """The decode rank's spec and, per group, the kernel blocks (states) one request fills:
    the prefill side's 2 logical blocks (run_tp's default), which the decode side covers."""
    pre = rank_spec(
        report.preset, report.prefill_tp, options=PREFILL_OPTIONS.get(report.preset, "")
    )
    return rank_spec(report.preset, report.decode_tp), [2 * g.ppl for g in pre.groups]


@pytest.mark.slow
def test_every_decode_rank_gets_every_block_it_needs(report: TPReport) -> None:
    assert report.ok, "\n".join(report.lines())
    spec, filled = _filled(report)
    model = MODELS[report.preset]
    for res in report.decode:
        assert res.blocks_checked == REQUESTS * sum(filled)
        # Each local byte is read exactly once over the rank's pulls: replicated heads and
        # MLA latents are not read twice.
        nbytes = sum(filled[r.group] * r.block_len for r in spec.regions)
        assert res.nbytes == REQUESTS * nbytes, "\n".join(report.lines())
        want = ranks_to_pull(model, res.rank, report.decode_tp, report.prefill_tp)
        assert all(src == want for src in res.sources.values()), (res.sources, want)
        assert res.pulls == REQUESTS * len(want)


@pytest.mark.slow
def test_ranks_that_hold_nothing_needed_end_done_reading_nothing(report: TPReport) -> None:
    """MLA 4:1: rank 0 is read, ranks 1-3 only release; replicated heads (hybrid, 2 heads over
    prefill TP 4): copies 1 and 3 are not read."""
    assert report.ok, "\n".join(report.lines())
    empty = sum(r.empty_pulls for r in report.decode)
    expected = {("mla", 2, 1): 1, ("mla", 4, 1): 3, ("hybrid", 4, 1): 2}
    key = (report.preset, report.prefill_tp, report.decode_tp)
    assert empty == REQUESTS * expected.get(key, 0), "\n".join(report.lines())
    assert not report.unreleased
    doc = json.loads(json.dumps(report.to_dict()))  # what `--json` would write
    assert doc["ok"] and sum(r["empty_pulls"] for r in doc["decode"]) == empty


def test_decode_bytes_are_the_prefill_ranks_head_slices() -> None:
    """The byte function depends on model-global heads only: a TP 1 HND block is, in each K/V
    half, the TP 2 ranks' halves one after the other; another head, token or shard differs."""
    whole = rank_spec("dense", 1).regions[0]
    half = rank_spec("dense", 2).regions[0]
    got = region_blocks(whole, 0, [3], 0, seed=5).reshape(2, -1)
    parts = [
        region_blocks(half, 0, [3], kv_head_range(r, 2, 8)[0], seed=5).reshape(2, -1)
        for r in range(2)
    ]
    assert np.array_equal(got, np.concatenate(parts, axis=1))
    spec = rank_spec("hybrid", 1)
    base = group_digests(spec, 0, range(4), 0, 5)
    assert base != group_digests(spec, 0, range(4), 1, 5)  # another head
    assert base != group_digests(spec, 0, range(1, 5), 0, 5)  # other tokens
    assert group_digests(spec, 1, [0], 0, 5) != group_digests(spec, 1, [0], 0, 5, shard=1)


@pytest.mark.slow
@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2)])
def test_nhd_under_head_slicing_is_refused_with_the_fix(p: int, d: int, tmp_path: Path) -> None:
    rep = run_tp(p, d, "dense:layout=NHD", requests=1, workdir=tmp_path)
    assert not rep.ok
    text = "\n".join(rep.refusals)
    assert "FAILED_PRECONDITION" in text and "HND" in text and "NHD" in text, text
    assert all(r.pulls == 0 and r.nbytes == 0 for r in rep.decode)


@pytest.mark.slow
def test_sharded_mamba_state_is_refused_under_heterogeneous_tp(tmp_path: Path) -> None:
    rep = run_tp(2, 1, "hybrid", requests=1, shard_state=True, workdir=tmp_path)
    text = "\n".join(rep.refusals)
    assert not rep.ok and "replicated across TP" in text and "mamba.0.conv" in text, text


@pytest.mark.slow
def test_sharded_mamba_state_at_equal_tp_is_read_per_rank(tmp_path: Path) -> None:
    rep = run_tp(2, 2, "hybrid", requests=1, shard_state=True, workdir=tmp_path)
    assert rep.ok, "\n".join(rep.lines())
    assert [r.sources["req-0"] for r in rep.decode] == [(0,), (1,)]


# -- the scheduler helper (kvxferd.client.ranks) against real daemons: MLA, prefill TP 2 ----


class _Mla2To1:
    def __init__(self, ds: DaemonSet) -> None:
        self.p_spec, self.d_spec = rank_spec("mla", 2), rank_spec("mla", 1)
        self.ready = {d.name: d.ready for d in ds}
        self.pools = []
        for name, spec, rank, tp in (
            ("p0", self.p_spec, 0, 2),
            ("p1", self.p_spec, 1, 2),
            ("d0", self.d_spec, 0, 1),
        ):
            ready = self.ready[name]
            assert ready is not None
            self.pools.append(
                AttachedPool(name, ready.engine_socket, spec, tp_rank=rank, tp_size=tp)
            )
        self.reqs = make_requests(self.p_spec, self.d_spec, 4, 2, seed=9)
        for pool in self.pools[:2]:
            for req in self.reqs:
                for i, r in enumerate(pool.spec.regions):
                    ids = kernel_ids(pool.spec, 0, req.remote_ids[0])
                    pool.write(i, ids, region_blocks(r, i, range(len(ids)), 0, 9))

    def client(self, name: str) -> DaemonClient:
        ready = self.ready[name]
        assert ready is not None
        return DaemonClient(name, ready.grpc, ready.engine_socket)

    def close(self) -> None:
        for pool in self.pools:
            pool.close()


@pytest.fixture(scope="module")
def mla(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Mla2To1]:
    opts = [
        DaemonOptions(name=n, preset="dense", extra=("--set", "pool.mode=attached"))
        for n in ("p0", "p1", "d0")
    ]
    with DaemonSet(tmp_path_factory.mktemp("mla"), opts) as ds:
        ds.start()
        ds.wait_ready()
        world = _Mla2To1(ds)
        try:
            yield world
        finally:
            world.close()


@pytest.mark.slow
def test_pull_from_ranks_reads_one_rank_and_releases_the_other(mla: _Mla2To1) -> None:
    model = TPModel(mla=True)
    assert hold_readers(model, 1, 2) == {0: 1, 1: 1}
    req = mla.reqs[0]
    prefill = [mla.client("p0"), mla.client("p1")]
    released = ReleaseWatcher(prefill[1])
    holds = {}
    for r, c in enumerate(prefill):
        h = c.hold(req.request_id, req.remote_ids, readers=hold_readers(model, 1, 2)[r])
        holds[r] = RankHold(
            h.peer_address, h.request_id, [list(g.ids) for g in h.remote_block_ids.groups]
        )
    ready = mla.ready["d0"]
    assert ready is not None
    with SchedulerClient(ready.grpc) as decode:
        out = pull_from_ranks(
            decode,
            holds,
            [list(req.local_ids[0])],
            model=model,
            local_rank=0,
            local_tp=1,
            remote_tp=2,
            timeout_s=60,
        )
        assert out.state is TransferState.DONE, out
        assert out.statuses[1].nbytes == 0 and out.statuses[0].nbytes == out.nbytes > 0
        ids = kernel_ids(mla.d_spec, 0, req.local_ids[0])
        got = decode.checksum(0, ids, kernel_block_ids=True)
        assert got == group_digests(mla.d_spec, 0, range(len(ids)), 0, 9)
    assert not released.wait([req.request_id], 30)
    assert released.reason(req.request_id) == "DONE"
    released.close()


@pytest.mark.slow
def test_pull_from_ranks_reports_the_first_failure(mla: _Mla2To1) -> None:
    model = TPModel(mla=True)
    req, other = mla.reqs[1], mla.reqs[2]
    p0, p1 = mla.client("p0"), mla.client("p1")
    h0 = p0.hold(req.request_id, req.remote_ids)
    h1 = p1.hold(req.request_id, req.remote_ids)
    holds = {
        0: RankHold(h0.peer_address, h0.request_id, [list(req.remote_ids[0])]),
        # Blocks rank 1 does not hold under this request: its owner refuses the lease.
        1: RankHold(h1.peer_address, h1.request_id, [list(other.remote_ids[0])]),
    }
    ready = mla.ready["d0"]
    assert ready is not None
    with SchedulerClient(ready.grpc) as decode:
        with pytest.raises(ValueError, match=r"no Hold for ranks \[1\]"):
            pull_from_ranks(
                decode,
                {0: holds[0]},
                [list(req.local_ids[0])],
                model=model,
                local_rank=0,
                local_tp=1,
                remote_tp=2,
            )
        out = pull_from_ranks(
            decode,
            holds,
            [list(req.local_ids[0])],
            model=model,
            local_rank=0,
            local_tp=1,
            remote_tp=2,
            timeout_s=60,
        )
    assert out.state is TransferState.FAILED and out.failed_rank == 1, out
    assert out.error is not None and "not held" in out.error.message, out.error
    assert out.statuses[0].state is TransferState.DONE


@pytest.mark.slow
def test_pull_from_ranks_async_pulls_every_rank_together(mla: _Mla2To1) -> None:
    model = TPModel(mla=True)
    req = mla.reqs[3]
    holds = {}
    for r in range(2):
        h = mla.client(f"p{r}").hold(req.request_id, req.remote_ids)
        holds[r] = RankHold(h.peer_address, h.request_id, [list(req.remote_ids[0])])
    ready = mla.ready["d0"]
    assert ready is not None

    async def go() -> RankedPull:
        async with AsyncSchedulerClient(ready.grpc) as decode:
            return await pull_from_ranks_async(
                decode,
                holds,
                [list(req.local_ids[0])],
                model=model,
                local_rank=0,
                local_tp=1,
                remote_tp=2,
                transfer_id="async-1",
                timeout_s=60,
            )

    out = asyncio.run(go())
    assert out.state is TransferState.DONE, out
    assert {r: s.transfer_id for r, s in out.statuses.items()} == {0: "async-1.r0", 1: "async-1.r1"}
    ids = kernel_ids(mla.d_spec, 0, req.local_ids[0])
    assert mla.client("d0").checksum(0, ids) == group_digests(mla.d_spec, 0, range(len(ids)), 0, 9)
