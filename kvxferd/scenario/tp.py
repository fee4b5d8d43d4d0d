"""Heterogeneous TP end to end: one daemon per rank, every decode rank's blocks verified.

:func:`run_tp` starts ``P`` prefill and ``D`` decode daemons (real processes, NIXL, gRPC on
``127.0.0.1:0``, pools attached as each rank's engine would), writes model-global bytes
(:mod:`.tp_bytes`) into the prefill ranks' blocks of a few requests, holds each request on
every prefill rank, has each decode rank pull from the prefill ranks it needs (one StartPull
per rank, :func:`.tp_plan.pull_sets`; the scheduler's protocol in docs/tp.md), and compares
every pulled block of every decode rank, through the daemons' ``Checksum``, with the bytes
that rank must hold. It also checks that every prefill rank released every hold as DONE.
A refused pull (NHD under head slicing, a sharded Mamba state, ...) is reported with the
daemon's reasons, not raised.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvxferd.blocks.tp import kv_head_range
from kvxferd.errors import KvxferdError
from kvxferd.layout.spec import KVCacheSpec
from kvxferd.scenario.client import (
    DaemonClient,
    ReleaseWatcher,
    RpcFailure,
    TransferWatcher,
    state_name,
)
from kvxferd.scenario.daemons import DaemonOptions, DaemonSet
from kvxferd.scenario.tp_bytes import group_digests, region_blocks
from kvxferd.scenario.tp_plan import (
    Request,
    kernel_ids,
    make_requests,
    paired,
    pull_sets,
    rank_spec,
    total_kv_heads,
)
from kvxferd.scenario.tp_pool import AttachedPool
from kvxferd.v1 import engine_pb2, scheduler_pb2

PULL_TIMEOUT_S = 60.0


@dataclass
class RankResult:
    """One decode rank: its pulls (one per prefill rank and request) and its verified blocks."""

    rank: int
    pulls: int = 0
    empty_pulls: int = 0  # DONE having read nothing (the rank only released its share)
    nbytes: int = 0
    blocks_checked: int = 0
    mismatches: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    sources: dict[str, tuple[int, ...]] = field(default_factory=dict)  # request -> ranks


@dataclass
class TPReport:
    """What :func:`run_tp` did and found; ``ok`` when every block matched and nothing failed."""

    prefill_tp: int
    decode_tp: int
    preset: str
    requests: int
    decode: list[RankResult] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    unreleased: list[str] = field(default_factory=list)
    prefill_mismatches: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def refuse(self, why: str) -> None:
        if why not in self.refusals:
            self.refusals.append(why)

    @property
    def ok(self) -> bool:
        return (
            not self.refusals
            and not self.unreleased
            and not self.prefill_mismatches
            and all(not r.mismatches and not r.failures for r in self.decode)
            and all(r.blocks_checked for r in self.decode)
        )

    def to_dict(self) -> dict[str, Any]:
        """Every figure, for ``--json``."""
        return {**dataclasses.asdict(self), "ok": self.ok}

    def lines(self) -> list[str]:
        head = (
            f"TP {self.prefill_tp}:{self.decode_tp} {self.preset}: {self.requests} requests,"
            f" {'OK' if self.ok else 'FAILED'} in {self.seconds:.1f}s"
        )
        out = [head]
        for r in self.decode:
            srcs = sorted({s for v in r.sources.values() for s in v})
            out.append(
                f"  decode rank {r.rank}: {r.pulls} pulls from prefill ranks {srcs}"
                f" ({r.empty_pulls} read nothing), {r.nbytes} bytes,"
                f" {r.blocks_checked} blocks verified by Checksum"
            )
            out += [f"    mismatch: {m}" for m in r.mismatches[:10]]
            out += [f"    failed: {f}" for f in r.failures[:10]]
        out += [f"  refused: {x}" for x in self.refusals]
        out += [f"  not released: {x}" for x in self.unreleased]
        out += [f"  prefill block wrong: {x}" for x in self.prefill_mismatches[:10]]
        return out


def _fill(pool: AttachedPool, req: Request, first_head: int, shard: int, seed: int) -> None:
    spec = pool.spec
    for i, r in enumerate(spec.regions):
        ids = kernel_ids(spec, r.group, req.remote_ids[r.group])
        pool.write(i, ids, region_blocks(r, i, range(len(ids)), first_head, seed, shard=shard))


@dataclass(frozen=True)
class _Side:
    """One side's TP size, per-rank spec and clients (``p<r>`` / ``d<r>``)."""

    tp: int
    spec: KVCacheSpec
    heads: int
    clients: list[DaemonClient]
    sockets: list[str]  # each rank's engine socket
    sharded: bool  # each rank holds its own shard of every state (else replicated)

    def first_head(self, rank: int) -> int:
        return kv_head_range(rank, self.tp, self.heads)[0] if self.heads else 0

    def shard(self, rank: int) -> int:
        return rank if self.sharded else 0


def _verify(
    side: _Side,
    rank: int,
    ids: tuple[tuple[int, ...], ...],
    *,
    seed: int,
    what: str,
    counts: list[int] | None = None,
) -> tuple[int, list[str]]:
    """Checksum the kernel blocks of a request on ``side``'s rank ``rank`` (the first
    ``counts[g]`` of group ``g``, default all) against the bytes that rank must hold."""
    checked, bad = 0, []
    for g in range(len(side.spec.groups)):
        kids = kernel_ids(side.spec, g, ids[g])
        if counts is not None:
            kids = kids[: counts[g]]
        want = group_digests(
            side.spec, g, range(len(kids)), side.first_head(rank), seed, shard=side.shard(rank)
        )
        got = side.clients[rank].checksum(g, kids)
        checked += len(kids)
        bad += [
            f"{what} group {g} kernel block {b} (request block {k})"
            for k, (b, w, h) in enumerate(zip(kids, want, got, strict=True))
            if w != h
        ]
    return checked, bad


def run_tp(
    prefill_tp: int,
    decode_tp: int,
    preset: str = "dense",
    *,
    requests: int = 2,
    blocks: int = 2,
    seed: int = 1,
    shard_state: bool = False,
    prefill_options: str = "",
    workdir: Path | None = None,
    timeout_s: float = PULL_TIMEOUT_S,
    device: str = "cpu",
) -> TPReport:
    """Run the scenario once with fresh daemons (see the module docstring); never leaves a
    daemon running. ``preset``: ``dense``, ``mla`` or ``hybrid``, with options after a colon
    (``dense:layout=NHD``); ``shard_state``: shard the Mamba states over the TP ranks (refused
    under heterogeneous TP); ``prefill_options``: options for the prefill side only
    (``hybrid`` with ``ppl=34`` against the decode side's 66: a prefix-caching-free pull
    trims to the tokens both hold, docs/domain.md §5); ``device``: ``cpu`` (pools in host
    memory) or ``cuda[:N]`` (every rank's pool on that GPU, which one GPU can hold for several
    ranks). Raises :class:`.daemons.DaemonError` if a daemon does not start."""
    t0 = time.monotonic()
    heads = total_kv_heads(preset)
    p_spec = rank_spec(preset, prefill_tp, shard_state=shard_state, options=prefill_options)
    d_spec = rank_spec(preset, decode_tp, shard_state=shard_state)
    reqs = make_requests(p_spec, d_spec, requests, blocks, seed)
    report = TPReport(prefill_tp, decode_tp, preset, requests)
    opts = [
        DaemonOptions(
            name=f"{side}{i}",
            preset="dense",
            device=device,
            extra=("--set", "pool.mode=attached"),
        )
        for side, n in (("p", prefill_tp), ("d", decode_tp))
        for i in range(n)
    ]
    with (
        tempfile.TemporaryDirectory(prefix="kvx-tp-", dir=workdir) as tmp,
        DaemonSet(Path(tmp), opts) as ds,
    ):
        ds.start()
        ds.wait_ready()
        sides = []
        for name, tp, spec in (("p", prefill_tp, p_spec), ("d", decode_tp, d_spec)):
            clients, sockets = [], []
            for i in range(tp):
                ready = ds[f"{name}{i}"].ready
                assert ready is not None
                clients.append(DaemonClient(f"{name}{i}", ready.grpc, ready.engine_socket))
                sockets.append(ready.engine_socket)
            sides.append(_Side(tp, spec, heads, clients, sockets, shard_state))
        run = _Run(report, sides[0], sides[1], seed, timeout_s, vram=device.startswith("cuda"))
        try:
            run.attach()
            run.go(reqs)
        finally:
            run.close()
    report.seconds = time.monotonic() - t0
    return report


class _Run:
    """One scenario run over started daemons."""

    def __init__(
        self,
        report: TPReport,
        prefill: _Side,
        decode: _Side,
        seed: int,
        timeout_s: float,
        *,
        vram: bool = False,
    ) -> None:
        self.vram = vram
        self.report, self.prefill, self.decode = report, prefill, decode
        self.seed, self.timeout_s = seed, timeout_s
        self.pools: list[AttachedPool] = []
        self.releases: list[ReleaseWatcher] = []
        self.watchers: list[TransferWatcher] = []

    def attach(self) -> None:
        for side in (self.prefill, self.decode):
            for i, (c, sock) in enumerate(zip(side.clients, side.sockets, strict=True)):
                self.pools.append(
                    AttachedPool(
                        c.name, sock, side.spec, tp_rank=i, tp_size=side.tp, vram=self.vram
                    )
                )
        self.releases = [ReleaseWatcher(c) for c in self.prefill.clients]

    def close(self) -> None:
        for w in self.watchers:
            w.close()
        for rw in self.releases:
            rw.close()
        for pool in self.pools:
            pool.close()
        for c in [*self.prefill.clients, *self.decode.clients]:
            c.close()

    def go(self, reqs: list[Request]) -> None:
        report, pre = self.report, self.prefill
        sets: dict[str, dict[int, tuple[int, ...]]] = {}
        for req in reqs:
            try:
                sets[req.request_id] = pull_sets(
                    pre.spec, [self.decode.spec] * self.decode.tp, pre.tp, req
                )
            except KvxferdError as err:  # let the daemons say it too: pull from every rank
                report.refuse(f"planner: {err}")
                sets[req.request_id] = {d: tuple(range(pre.tp)) for d in range(self.decode.tp)}
        holds: dict[tuple[str, int], engine_pb2.HoldResponse] = {}
        for req in reqs:
            for r in range(pre.tp):
                _fill(self.pools[r], req, pre.first_head(r), pre.shard(r), self.seed)
                readers = sum(r in s for s in sets[req.request_id].values())
                holds[req.request_id, r] = pre.clients[r].hold(
                    req.request_id, req.remote_ids, readers=readers
                )
                # The fill itself, read back through the prefill daemon.
                what = f"prefill rank {r} {req.request_id}"
                report.prefill_mismatches += _verify(
                    pre, r, req.remote_ids, seed=self.seed, what=what
                )[1]
        report.decode = [RankResult(d) for d in range(self.decode.tp)]
        for d, res in enumerate(report.decode):
            watcher = TransferWatcher(self.decode.clients[d])
            self.watchers.append(watcher)
            for req in reqs:
                res.sources[req.request_id] = sets[req.request_id][d]
                if self._pull(res, watcher, req, holds):
                    counts = [
                        paired(pre.spec, self.decode.spec, g, req)
                        for g in range(len(pre.spec.groups))
                    ]
                    n, bad = _verify(
                        self.decode,
                        d,
                        req.local_ids,
                        seed=self.seed,
                        what=req.request_id,
                        counts=counts,
                    )
                    res.blocks_checked += n
                    res.mismatches += bad
        if not report.refusals:
            self._check_releases([q.request_id for q in reqs])

    def _pull(
        self,
        res: RankResult,
        watcher: TransferWatcher,
        req: Request,
        holds: dict[tuple[str, int], engine_pb2.HoldResponse],
    ) -> bool:
        """Pull ``req`` into decode rank ``res.rank`` from each of its prefill ranks; True
        when every pull is DONE (the one status a scheduler waits on)."""
        client = self.decode.clients[res.rank]
        pending = []
        for r in res.sources[req.request_id]:
            tid = f"{req.request_id}.d{res.rank}.p{r}"
            p = watcher.expect(tid)
            try:
                client.start_pull(tid, holds[req.request_id, r], req.local_ids)
            except RpcFailure as exc:
                self.report.refuse(
                    f"decode rank {res.rank} from prefill rank {r}: " + " | ".join(exc.explain())
                )
                continue
            pending.append((r, p))
        done = bool(pending) and len(pending) == len(res.sources[req.request_id])
        for r, p in pending:
            st = watcher.wait(p, self.timeout_s)
            res.pulls += 1
            res.nbytes += st.nbytes
            if st.state != scheduler_pb2.TRANSFER_STATE_DONE:
                done = False
                res.failures.append(
                    f"{req.request_id} from prefill rank {r}: {state_name(st.state)}"
                    f" {st.error.message}"
                )
            elif st.nbytes == 0:
                res.empty_pulls += 1
        return done

    def _check_releases(self, ids: list[str]) -> None:
        for r, rw in enumerate(self.releases):
            missing = rw.wait(ids, self.timeout_s)
            self.report.unreleased += [f"prefill rank {r}: {x}" for x in sorted(missing)]
            self.report.unreleased += [
                f"prefill rank {r}: {x} released as {rw.reason(x)}, not DONE"
                for x in ids
                if x not in missing and rw.reason(x) != "DONE"
            ]
