"""``kvxferd demo``: disaggregated KV transfer end to end on this machine, every block verified.

Starts a prefill daemon (pool filled with a deterministic pattern) and a decode daemon as
separate ``kvxferd serve`` processes on loopback, then plays the scheduler and the prefill
engine over the real gRPC API: per request, ``Hold`` on the prefill engine socket,
``StartPull`` on the decode daemon, the terminal state from one ``WatchTransfers`` stream,
then every pulled kernel block is verified with ``Checksum``: the decode block must now equal
the prefill block the planner pairs it with (:func:`kvxferd.blocks.plan_pull` on both
daemons' described specs) and must have changed from what it held before the pull.

A third and fourth daemon show one refusal: ``ppl`` differing with prefix caching on is refused
at the handshake (FAILED_PRECONDITION), and the daemon's explanation is printed.

Exit 0: every request DONE and verified, the refusal refused; 1: any mismatch or unexpected
failure; 2: usage error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import secrets
import shutil
import sys
import tempfile
import textwrap
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvxferd.blocks import PullPlan, plan_pull
from kvxferd.commands import Subparsers, positive_int
from kvxferd.errors import KvxferdError
from kvxferd.layout.spec import KVCacheSpec
from kvxferd.scenario.client import (
    TERMINAL,
    DaemonClient,
    Pending,
    ReleaseWatcher,
    RpcFailure,
    TransferWatcher,
    state_name,
)
from kvxferd.scenario.daemons import DaemonError, DaemonOptions, DaemonSet
from kvxferd.scenario.mix import (
    BlockAllocator,
    Int64Array,
    RequestShape,
    geometry,
    request_mix,
)
from kvxferd.scenario.report import Progress, fmt, human_bytes, json_safe, percentile, table
from kvxferd.v1 import common_pb2, scheduler_pb2

PRESET_NAMES = ("dense", "hybrid", "mla", "fp8")
DEFAULT_NUM_BLOCKS = {"dense": 256, "hybrid": 32, "mla": 64, "fp8": 256}
MIN_NUM_BLOCKS = 16
HYBRID_DECODE_PPL, HYBRID_PREFILL_PPL = 34, 66
WAIT_TIMEOUT_S = 90.0
RELEASE_TIMEOUT_S = 10.0
DIGEST_SIZE = 8

_EXAMPLES = """\
examples:
  kvxferd demo                          dense Llama-3-8B-shaped pools, 12 requests
  kvxferd demo --preset hybrid          attention + Mamba, ppl 34 (decode) vs 66 (prefill)
  kvxferd demo --requests 6 --num-blocks 64 --quiet --json demo.json
"""


def _num_blocks(text: str) -> int:
    n = positive_int(text)
    if n < MIN_NUM_BLOCKS:
        raise argparse.ArgumentTypeError(f"--num-blocks must be at least {MIN_NUM_BLOCKS}")
    return n


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help="run a prefill and a decode daemon and verify every pulled block",
        description=(
            "Start a prefill and a decode daemon on loopback (owned pools in host memory by"
            " default), hold and pull a mix of requests over the real gRPC API (short and long"
            " prompts, contiguous and fragmented block IDs, prefix-cache hits including a full"
            " hit; for the hybrid preset different ppl on the two sides), verify every pulled"
            " kernel block with Checksum, and show one refused pair (ppl differing with prefix"
            " caching on). Exit 0: all verified; 1: a mismatch or unexpected failure."
        ),
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--preset",
        choices=PRESET_NAMES,
        default="dense",
        help="model shape of both pools (default dense: Llama-3-8B-like)",
    )
    p.add_argument(
        "--requests", type=positive_int, default=12, metavar="N", help="requests (default 12)"
    )
    p.add_argument(
        "--num-blocks",
        type=_num_blocks,
        default=None,
        metavar="N",
        help=(
            "logical blocks per KV cache group of the prefill pool; the decode pool holds as"
            " many tokens (default: dense 256 = 512 MiB, hybrid 32, mla 64, fp8 256)"
        ),
    )
    p.add_argument("--seed", type=int, default=0, metavar="S", help="request mix seed (default 0)")
    p.add_argument(
        "--concurrency",
        type=positive_int,
        default=1,
        metavar="C",
        help="requests in flight at once (default 1: latencies without queueing)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="pool memory: cpu (DRAM, default) or cuda (prefill cuda:0, decode cuda:1 if present)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress output (summary only)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write every figure as JSON")
    p.add_argument(
        "--log-dir",
        type=Path,
        metavar="DIR",
        help="keep the daemons' logs, sockets and ready files here (default: a temporary"
        " directory, removed unless the demo fails)",
    )
    p.add_argument(
        "--engine",
        choices=("none", "vllm"),
        default="none",
        help="none (default): the demo plays the engines; vllm: real vLLM engines with"
        " kvxferd's connector beside vLLM's NixlConnector (docs/vllm.md)",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds to wait for the daemons to start (default 120)",
    )
    return p


# ---- configuration ------------------------------------------------------------------------


@dataclass(frozen=True)
class PairConfig:
    """The two daemons of one scenario and how to pair their blocks."""

    prefill: DaemonOptions
    decode: DaemonOptions
    prefix_caching: bool


def _devices(device: str) -> tuple[str, str]:
    if device == "cpu":
        return "cpu", "cpu"
    import torch

    n = torch.cuda.device_count()
    if n == 0:
        raise KvxferdError(
            "--device cuda but torch sees no CUDA device", fix="use --device cpu on this machine"
        )
    return "cuda:0", "cuda:1" if n >= 2 else "cuda:0"


def demo_pair(preset: str, num_blocks: int, *, device: str = "cpu", seed: int = 0) -> PairConfig:
    """The prefill/decode daemons of ``kvxferd demo --preset preset``."""
    dev_p, dev_d = _devices(device)
    fill = 1000 + seed
    if preset == "hybrid":
        decode_blocks = math.ceil(num_blocks * HYBRID_PREFILL_PPL / HYBRID_DECODE_PPL)
        return PairConfig(
            prefill=DaemonOptions(
                "prefill",
                f"hybrid:ppl={HYBRID_PREFILL_PPL},num_blocks={num_blocks}",
                device=dev_p,
                fill_seed=fill,
            ),
            decode=DaemonOptions(
                "decode",
                f"hybrid:ppl={HYBRID_DECODE_PPL},num_blocks={decode_blocks}",
                device=dev_d,
            ),
            prefix_caching=False,
        )
    spec = f"{preset}:num_blocks={num_blocks}"
    return PairConfig(
        prefill=DaemonOptions("prefill", spec, device=dev_p, prefix_caching=True, fill_seed=fill),
        decode=DaemonOptions("decode", spec, device=dev_d, prefix_caching=True),
        prefix_caching=True,
    )


def refusal_pair() -> PairConfig:
    """A pair the handshake must refuse: ppl 34 vs 66 with prefix caching on."""
    return PairConfig(
        prefill=DaemonOptions(
            "refused-prefill",
            f"hybrid:ppl={HYBRID_PREFILL_PPL},num_blocks=2",
            prefix_caching=True,
        ),
        decode=DaemonOptions(
            "refused-decode", f"hybrid:ppl={HYBRID_DECODE_PPL},num_blocks=2", prefix_caching=True
        ),
        prefix_caching=True,
    )


# ---- one request --------------------------------------------------------------------------


@dataclass
class RequestResult:
    """What happened to one request (one row of the JSON's ``per_request``)."""

    index: int
    kind: str
    pattern: str
    tokens: int
    cached_tokens: int
    full_hit: bool
    request_id: str
    transfer_id: str
    local_blocks: list[int] = field(default_factory=list)  # logical, per group
    remote_blocks: list[int] = field(default_factory=list)
    requested_blocks: int = 0  # paired kernel blocks, all groups
    verified_blocks: int = 0
    changed_blocks: int = 0
    preloaded_blocks: int = 0
    ambiguous_blocks: int = 0
    state: str = ""
    nbytes: int = 0
    planned_nbytes: int = 0
    descriptors_naive: int = 0
    descriptors_posted: int = 0
    latency_ms: float = math.nan
    server_ms: float = math.nan
    started_at: float = math.nan  # time.perf_counter() at StartPull
    ended_at: float = math.nan  # time.perf_counter() when the terminal status arrived
    via: str = ""
    released: str = ""
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and self.state == "DONE"


@dataclass
class _InFlight:
    result: RequestResult
    local_ids: list[Int64Array]
    plan: PullPlan
    expected: list[list[bytes]]
    before: list[list[bytes]]
    pending: Pending
    started: float


def _digests(client: DaemonClient, kernel_ids: tuple[Int64Array, ...]) -> list[list[bytes]]:
    """Checksum of every group's kernel blocks (an empty list for a group with none)."""
    return [client.checksum(g, ids) if ids.size else [] for g, ids in enumerate(kernel_ids)]


def _zero_digest(spec: KVCacheSpec, group: int) -> bytes:
    """The Checksum digest of a never-written (zeroed) kernel block of ``group``."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for r in spec.regions_of(group):
        h.update(bytes(r.block_len))
    return h.digest()


class Scenario:
    """Plays the scheduler and the prefill engine against one prefill/decode pair."""

    def __init__(
        self,
        prefill: DaemonClient,
        decode: DaemonClient,
        pair: PairConfig,
        *,
        seed: int,
        concurrency: int,
        progress: Progress,
        check_alive: Callable[[], None] = lambda: None,
    ) -> None:
        self.prefill = prefill
        self.check_alive = check_alive
        self.decode = decode
        self.pair = pair
        self.concurrency = concurrency
        self.progress = progress
        self.rng = np.random.default_rng(seed)
        self.remote_spec = prefill.spec()
        self.local_spec = decode.spec()
        self.local_geo = geometry(self.local_spec)
        self.remote_geo = geometry(self.remote_spec)
        n = len(self.local_spec.groups)
        self.local_alloc = [
            BlockAllocator(self.local_spec.num_logical_blocks(g), self.rng) for g in range(n)
        ]
        self.remote_alloc = [
            BlockAllocator(self.remote_spec.num_logical_blocks(g), self.rng, lru=False)
            for g in range(len(self.remote_spec.groups))
        ]
        self.zero = [_zero_digest(self.local_spec, g) for g in range(n)]
        self.results: list[RequestResult] = []
        self.errors: list[str] = []
        self.held: dict[str, list[Int64Array]] = {}  # request_id -> prefill IDs, until released
        self.done_requests: list[str] = []
        self.run_id = secrets.token_hex(3)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checksum")

    # -- prefill blocks come back when the prefill daemon releases them -------------------

    def _reclaim(self, releases: ReleaseWatcher | None) -> None:
        if releases is None:
            return
        for rid in [r for r in self.held if r in releases.released]:
            for g, ids in enumerate(self.held.pop(rid)):
                self.remote_alloc[g].release(ids)

    def _allocate(self, shape: RequestShape) -> tuple[list[Int64Array], list[Int64Array]] | None:
        r_counts = shape.remote_counts(self.remote_geo)
        l_counts = shape.local_counts(self.local_geo, self.remote_geo)
        remote: list[Int64Array] = []
        local: list[Int64Array] = []
        for g, n in enumerate(r_counts):
            ids = self.remote_alloc[g].take(n, shape.pattern)
            if ids is None:
                break
            remote.append(ids)
        if len(remote) == len(r_counts):
            for g, n in enumerate(l_counts):
                ids = self.local_alloc[g].take(n, shape.pattern)
                if ids is None:
                    break
                local.append(ids)
        if len(remote) == len(r_counts) and len(local) == len(l_counts):
            return local, remote
        for g, ids in enumerate(remote):
            self.remote_alloc[g].release(ids)
        for g, ids in enumerate(local):
            self.local_alloc[g].release(ids)
        return None

    def _start(
        self,
        shape: RequestShape,
        local: list[Int64Array],
        remote: list[Int64Array],
        watcher: TransferWatcher,
    ) -> _InFlight | None:
        rid = f"demo-{self.run_id}-{shape.index:04d}"
        res = RequestResult(
            index=shape.index,
            kind=shape.kind,
            pattern=shape.pattern,
            tokens=shape.tokens,
            cached_tokens=shape.cached_tokens,
            full_hit=shape.full_hit,
            request_id=rid,
            transfer_id=f"{rid}-pull",
            local_blocks=[int(a.size) for a in local],
            remote_blocks=[int(a.size) for a in remote],
        )
        self.results.append(res)
        try:
            plan = plan_pull(
                self.local_spec,
                self.remote_spec,
                local,
                remote,
                prefix_caching=self.pair.prefix_caching,
            )
        except KvxferdError as exc:  # the mix is wrong: a bug of this demo
            res.errors.append(f"the planner refused the demo's own request: {exc}")
            self._free_local(local)
            for g, ids in enumerate(remote):
                self.remote_alloc[g].release(ids)
            return None
        res.requested_blocks = sum(int(a.size) for a in plan.local_kernel_blocks)
        res.planned_nbytes = plan.nbytes
        try:
            hold = self.prefill.hold(rid, remote)
        except RpcFailure as exc:
            res.errors.append(str(exc))
            self._free_local(local)
            for g, ids in enumerate(remote):
                self.remote_alloc[g].release(ids)
            return None
        self.held[rid] = remote
        try:
            # The two daemons hash in parallel (separate processes; gRPC waits drop the GIL).
            f_expected = self._pool.submit(_digests, self.prefill, plan.remote_kernel_blocks)
            before = _digests(self.decode, plan.local_kernel_blocks)
            expected = f_expected.result()
            local, plan, before, expected = self._avoid_preloaded(
                shape, local=local, remote=remote, plan=plan, before=before, expected=expected
            )
            res.requested_blocks = sum(int(a.size) for a in plan.local_kernel_blocks)
            pending = watcher.expect(res.transfer_id)
            started = time.perf_counter()
            resp = self.decode.start_pull(res.transfer_id, hold, local)
        except (RpcFailure, KvxferdError) as exc:
            res.errors.append(str(exc))
            self._free_local(local)
            return None
        if resp.status.state in TERMINAL:
            watcher.resolve(pending, resp.status, "StartPull")
        return _InFlight(res, local, plan, expected, before, pending, started)

    def _avoid_preloaded(
        self,
        shape: RequestShape,
        *,
        local: list[Int64Array],
        remote: list[Int64Array],
        plan: PullPlan,
        before: list[list[bytes]],
        expected: list[list[bytes]],
        attempts: int = 3,
    ) -> tuple[list[Int64Array], PullPlan, list[list[bytes]], list[list[bytes]]]:
        """Decode blocks that already hold what they are about to receive (a reused block
        paired with the same prefill block as before) would not show that the pull wrote
        them: trade such local IDs for others while the pool has room. Returns the local IDs,
        their plan, and the before / expected digests in that plan's order."""
        # The plan orders pairs by local ID: remember each remote kernel block's digest.
        digest_of = [
            dict(zip(rk.tolist(), eg, strict=True))
            for rk, eg in zip(plan.remote_kernel_blocks, expected, strict=True)
        ]
        rejected: list[list[Int64Array]] = []

        def clashes(bef: list[list[bytes]], exp: list[list[bytes]]) -> bool:
            return any(
                b == e for bg, eg in zip(bef, exp, strict=True) for b, e in zip(bg, eg, strict=True)
            )

        for _ in range(attempts):
            if not clashes(before, expected):
                break
            alt: list[Int64Array] = []
            for g, old in enumerate(local):
                got = self.local_alloc[g].take(int(old.size), shape.pattern)
                if got is None:
                    break
                alt.append(got)
            if len(alt) != len(local):
                self._free_local(alt)
                break
            rejected.append(local)
            local = alt
            plan = plan_pull(
                self.local_spec,
                self.remote_spec,
                local,
                remote,
                prefix_caching=self.pair.prefix_caching,
            )
            before = _digests(self.decode, plan.local_kernel_blocks)
            expected = [
                [digest_of[g][k] for k in rk.tolist()]
                for g, rk in enumerate(plan.remote_kernel_blocks)
            ]
        for ids in rejected:
            self._free_local(ids)
        return local, plan, before, expected

    def _free_local(self, local: list[Int64Array]) -> None:
        for g, ids in enumerate(local):
            self.local_alloc[g].release(ids)

    def _finish(self, item: _InFlight, watcher: TransferWatcher) -> None:
        res = item.result
        try:
            st = watcher.wait(item.pending, WAIT_TIMEOUT_S)
        except (TimeoutError, RpcFailure) as exc:
            res.errors.append(str(exc))
            res.state = "TIMEOUT"
            self._free_local(item.local_ids)
            return
        res.state = state_name(st.state)
        res.started_at, res.ended_at = item.started, item.pending.terminal_at
        res.latency_ms = (item.pending.terminal_at - item.started) * 1e3
        res.via = item.pending.via
        if st.finished_unix_ns and st.created_unix_ns:
            res.server_ms = (st.finished_unix_ns - st.created_unix_ns) / 1e6
        res.nbytes = st.nbytes
        res.descriptors_naive = st.descriptors_before_coalescing
        res.descriptors_posted = st.descriptors_after_coalescing
        if st.state != scheduler_pb2.TRANSFER_STATE_DONE:
            why = st.error.message if st.HasField("error") else "no error detail"
            res.errors.append(f"transfer {res.transfer_id} ended {res.state}: {why}")
            self._free_local(item.local_ids)
            return
        self.done_requests.append(res.request_id)
        if st.nbytes != item.plan.nbytes:
            res.errors.append(
                f"the daemon reports {st.nbytes} bytes, the plan of these IDs reads"
                f" {item.plan.nbytes}"
            )
        try:
            self._verify(item)
        except RpcFailure as exc:
            res.errors.append(str(exc))
        self._free_local(item.local_ids)

    def _verify(self, item: _InFlight) -> None:
        res = item.result
        for g, lk in enumerate(item.plan.local_kernel_blocks):
            if lk.size == 0:
                continue
            rk = item.plan.remote_kernel_blocks[g]
            after = self.decode.checksum(g, lk)
            expected, before = item.expected[g], item.before[g]
            dupes = Counter(expected)
            res.ambiguous_blocks += sum(1 for d in expected if dupes[d] > 1)
            bad = [i for i, (a, e) in enumerate(zip(after, expected, strict=True)) if a != e]
            blank = [i for i, e in enumerate(expected) if e == self.zero[g]]
            res.changed_blocks += sum(1 for a, b in zip(after, before, strict=True) if a != b)
            res.preloaded_blocks += sum(1 for b, e in zip(before, expected, strict=True) if b == e)
            res.verified_blocks += sum(
                1 for a, e in zip(after, expected, strict=True) if a == e and e != self.zero[g]
            )
            name = self.local_spec.groups[g].name
            if bad:
                pairs = ", ".join(f"{int(lk[i])}<-{int(rk[i])}" for i in bad[:4])
                res.errors.append(
                    f"group {name!r}: {len(bad)} of {lk.size} pulled kernel blocks differ from"
                    f" their prefill blocks (local<-remote: {pairs})"
                )
            if blank:
                res.errors.append(
                    f"group {name!r}: {len(blank)} prefill blocks read as never written"
                    f" (e.g. remote kernel block {int(rk[blank[0]])}): was --fill-pattern"
                    " applied?"
                )

    def _line(self, res: RequestResult) -> str:
        lat = f"{res.latency_ms:8.2f} ms" if math.isfinite(res.latency_ms) else "       - ms"
        verdict = "ok" if res.ok else "FAILED: " + "; ".join(res.errors)
        return (
            f"request {res.index + 1:>3}  {res.kind:<10} {res.pattern:<10}"
            f" {res.tokens:>6} tok  {res.verified_blocks:>5}/{res.requested_blocks:<5} blocks"
            f"  {human_bytes(res.nbytes):>10}  {lat}  {res.state or '-':<9} {verdict}"
        )

    def run(self, shapes: list[RequestShape]) -> None:
        watcher = TransferWatcher(self.decode)
        releases: ReleaseWatcher | None
        try:
            releases = ReleaseWatcher(self.prefill)
        except RpcFailure as exc:
            self.errors.append(f"cannot watch prefill releases: {exc}")
            releases = None
        try:
            self._loop(shapes, watcher, releases)
            self._check_releases(releases)
        finally:
            watcher.close()
            if releases is not None:
                releases.close()
            self._pool.shutdown()
        self.progress.finish()

    def _loop(
        self,
        shapes: list[RequestShape],
        watcher: TransferWatcher,
        releases: ReleaseWatcher | None,
    ) -> None:
        queue = deque(shapes)
        inflight: deque[_InFlight] = deque()
        done = 0
        while queue or inflight:
            while queue and len(inflight) < self.concurrency:
                self._reclaim(releases)
                ids = self._allocate(queue[0])
                if ids is None:
                    if inflight:
                        break
                    if not self._await_releases(releases):
                        shape = queue.popleft()
                        self.errors.append(f"request {shape.index + 1}: no room in the pools")
                    continue
                item = self._start(queue.popleft(), *ids, watcher)
                if item is None:
                    done += 1
                    res = self.results[-1]
                    self.progress.update(done, self._bar_text(), line=self._line(res))
                    self.check_alive()  # a dead daemon ends the run with its output's tail
                else:
                    inflight.append(item)
            if inflight:
                item = inflight.popleft()
                self._finish(item, watcher)
                done += 1
                self.progress.update(done, self._bar_text(), line=self._line(item.result))
                if item.result.errors:
                    self.check_alive()

    def _await_releases(self, releases: ReleaseWatcher | None) -> bool:
        """Nothing in flight yet no room: wait for the prefill daemon to release held blocks;
        give blocks it never releases back by force (recording the failure)."""
        waiting = list(self.held)
        if not waiting:
            return False
        missing = set(waiting)
        if releases is not None:
            missing = releases.wait(waiting, RELEASE_TIMEOUT_S)
        self._reclaim(releases)
        for rid in missing:
            if rid in self.held:
                self.errors.append(
                    f"the prefill daemon did not release {rid} within {RELEASE_TIMEOUT_S:.0f}s"
                )
                for g, ids in enumerate(self.held.pop(rid)):
                    self.remote_alloc[g].release(ids)
        return True

    def _check_releases(self, releases: ReleaseWatcher | None) -> None:
        if releases is None:
            return
        missing = releases.wait(self.done_requests, RELEASE_TIMEOUT_S)
        if releases.error and missing:
            self.errors.append(f"release check incomplete: {releases.error}")
        by_id = {r.request_id: r for r in self.results}
        for rid in self.done_requests:
            res = by_id[rid]
            res.released = releases.reason(rid)
            if rid in missing:
                res.errors.append(
                    f"the prefill daemon did not release {rid} within {RELEASE_TIMEOUT_S:.0f}s"
                    " of the pull being DONE"
                )
            elif res.released != "DONE":
                res.errors.append(f"the prefill daemon released {rid} as {res.released}, not DONE")

    def _bar_text(self) -> str:
        nbytes = sum(r.nbytes for r in self.results)
        lat = [r.latency_ms for r in self.results if math.isfinite(r.latency_ms)]
        fails = sum(1 for r in self.results if r.errors)
        p50 = f"p50 {percentile(lat, 50):.1f} ms" if lat else ""
        return f"{human_bytes(nbytes)} pulled  {p50}  {fails} failed"


# ---- the refusal --------------------------------------------------------------------------


def demonstrate_refusal(prefill: DaemonClient, decode: DaemonClient) -> dict[str, Any]:
    """Hold one request on the refusing prefill daemon and pull it; the handshake must refuse."""
    out: dict[str, Any] = {
        "refused": False,
        "code": "",
        "message": "",
        "mismatches": [],
        "error": "",
    }
    rid = f"refusal-{secrets.token_hex(3)}"
    try:
        hold = prefill.hold(rid, [[0], [0]])
        resp = decode.start_pull(f"{rid}-pull", hold, [[0, 1], [0]])
    except RpcFailure as exc:
        out["code"] = exc.code.name
        out["message"] = exc.details
        out["explanation"] = exc.explain()
        if exc.error is not None:
            out["mismatches"] = [
                {"what": m.what, "local": m.local, "remote": m.remote, "fix": m.fix}
                for m in exc.error.mismatches
            ]
        if exc.code.name == "FAILED_PRECONDITION" and exc.method.endswith("StartPull"):
            out["refused"] = True
        else:
            out["error"] = f"expected FAILED_PRECONDITION on StartPull, got {exc}"
        return out
    st = resp.status
    deadline = time.monotonic() + 30
    while st.state not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.05)
        st = decode.get_transfer(st.transfer_id)
    kind = common_pb2.ErrorKind.Name(st.error.kind) if st.HasField("error") else ""
    out["code"] = state_name(st.state)
    out["message"] = st.error.message if st.HasField("error") else ""
    out["error"] = (
        f"StartPull accepted the pull (it ended {state_name(st.state)} {kind}); the handshake"
        " must refuse it with FAILED_PRECONDITION"
    )
    return out


# ---- summary ------------------------------------------------------------------------------


def summarize(results: list[RequestResult], busy_s: float) -> dict[str, Any]:
    done = [r for r in results if r.state == "DONE"]
    lat = [r.latency_ms for r in done if math.isfinite(r.latency_ms)]
    srv = [r.server_ms for r in done if math.isfinite(r.server_ms)]
    nbytes = sum(r.nbytes for r in done)
    return {
        "requests": len(results),
        "requests_done": len(done),
        "requested_blocks": sum(r.requested_blocks for r in results),
        "verified_blocks": sum(r.verified_blocks for r in results),
        "changed_blocks": sum(r.changed_blocks for r in results),
        "preloaded_blocks": sum(r.preloaded_blocks for r in results),
        "ambiguous_blocks": sum(r.ambiguous_blocks for r in results),
        "bytes": nbytes,
        "busy_s": busy_s,
        "throughput_gbps": nbytes / busy_s / 1e9 if busy_s > 0 else math.nan,
        "latency_ms": {
            "p50": percentile(lat, 50),
            "p90": percentile(lat, 90),
            "p99": percentile(lat, 99),
            "max": max(lat) if lat else math.nan,
        },
        "server_latency_ms": {"p50": percentile(srv, 50), "p99": percentile(srv, 99)},
        "descriptors": {
            "naive": sum(r.descriptors_naive for r in done),
            "posted": sum(r.descriptors_posted for r in done),
        },
        "failed_requests": sum(1 for r in results if not r.ok),
    }


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end]`` intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summary_table(results: list[RequestResult]) -> str:
    groups: dict[tuple[str, str], list[RequestResult]] = {}
    for r in results:
        groups.setdefault((r.kind, r.pattern), []).append(r)
    rows = []
    for (kind, pattern), rs in [*groups.items(), (("total", ""), results)]:
        done = [r for r in rs if r.state == "DONE"]
        lat = [r.latency_ms for r in done if math.isfinite(r.latency_ms)]
        busy = busy_seconds([(r.started_at, r.ended_at) for r in done])
        nbytes = sum(r.nbytes for r in done)
        rows.append(
            [
                kind,
                pattern,
                str(len(rs)),
                f"{sum(r.verified_blocks for r in rs)}/{sum(r.requested_blocks for r in rs)}",
                human_bytes(nbytes),
                fmt(nbytes / busy / 1e9 if busy > 0 else math.nan),
                fmt(percentile(lat, 50)),
                fmt(percentile(lat, 90)),
                fmt(percentile(lat, 99)),
                f"{sum(r.descriptors_naive for r in done):,}",
                f"{sum(r.descriptors_posted for r in done):,}",
                str(sum(1 for r in rs if not r.ok)),
            ]
        )
    headers = [
        "kind",
        "pattern",
        "reqs",
        "verified blocks",
        "bytes",
        "GB/s",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "descs naive",
        "descs posted",
        "failed",
    ]
    return table(headers, rows, left=2)


# ---- run ----------------------------------------------------------------------------------


def _describe_side(client: DaemonClient, options: DaemonOptions) -> dict[str, Any]:
    info = client.describe()
    return {
        "preset": options.preset,
        "device": options.device,
        "prefix_caching": options.prefix_caching,
        "grpc": client.grpc_address,
        "peer_address": info.peer_address,
        "nixl_agent": info.nixl_agent_name,
        "pool_bytes": sum(r.nbytes for r in info.registrations),
        "held_requests": info.held_requests,
    }


def run(args: argparse.Namespace) -> int:
    if getattr(args, "engine", "none") == "vllm":
        from kvxferd.commands import demo_vllm

        return demo_vllm.run(args)
    num_blocks: int = args.num_blocks or DEFAULT_NUM_BLOCKS[args.preset]
    pair = demo_pair(args.preset, num_blocks, device=args.device, seed=args.seed)
    refusal = refusal_pair()
    out = sys.stdout
    progress = Progress.auto(args.requests, quiet=args.quiet)
    workdir = args.log_dir
    temporary = workdir is None
    if workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="kvxd-"))
    else:
        workdir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "requests_asked": args.requests,
        "preset": args.preset,
        "device": args.device,
        "num_blocks": num_blocks,
        "prefix_caching": pair.prefix_caching,
        "seed": args.seed,
        "concurrency": args.concurrency,
    }
    errors: list[str] = []
    results: list[RequestResult] = []
    busy_s = 0.0
    daemons = DaemonSet(workdir, [pair.prefill, pair.decode, refusal.prefill, refusal.decode])
    print(
        f"kvxferd demo: preset {args.preset}, {args.requests} requests, prefix caching"
        f" {'on' if pair.prefix_caching else 'off'}, pools in"
        f" {'host memory' if args.device == 'cpu' else 'GPU memory'}",
        file=out,
        flush=True,
    )
    t_start = time.monotonic()
    clients: list[DaemonClient] = []
    scenario: Scenario | None = None
    try:
        with daemons:
            daemons.start()
            progress.message(f"starting 4 daemons (logs in {workdir}) ...")
            daemons.wait_ready(args.ready_timeout)
            doc["startup_s"] = time.monotonic() - t_start
            ready = {d.name: d.ready for d in daemons}
            for name in ("prefill", "decode", "refused-prefill", "refused-decode"):
                info = ready[name]
                assert info is not None
                clients.append(DaemonClient(name, info.grpc, info.engine_socket))
            prefill, decode, r_prefill, r_decode = clients
            doc["daemons"] = {
                "prefill": _describe_side(prefill, pair.prefill),
                "decode": _describe_side(decode, pair.decode),
            }
            for side in ("prefill", "decode"):
                d = doc["daemons"][side]
                print(
                    f"  {side:<8} {d['preset']:<28} {d['device']:<7} pool"
                    f" {human_bytes(d['pool_bytes']):>10}  grpc {d['grpc']}",
                    file=out,
                    flush=True,
                )
            scenario = Scenario(
                prefill,
                decode,
                pair,
                seed=args.seed,
                concurrency=args.concurrency,
                progress=progress,
                check_alive=daemons.check_alive,
            )
            shapes = request_mix(
                args.requests,
                local=scenario.local_geo,
                remote=scenario.remote_geo,
                prefix_caching=pair.prefix_caching,
                seed=args.seed,
            )
            scenario.run(shapes)
            doc["held_after"] = prefill.describe().held_requests
            doc["refusal"] = demonstrate_refusal(r_prefill, r_decode)
            daemons.check_alive()
    except DaemonError as exc:
        progress.finish()
        errors.append(str(exc))
    except RpcFailure as exc:
        progress.finish()
        errors.append(f"unexpected: {exc}")
    finally:
        for c in clients:
            c.close()
    if scenario is not None:
        results = scenario.results
        errors.extend(scenario.errors)
        busy_s = busy_seconds([(r.started_at, r.ended_at) for r in results if r.state == "DONE"])
    errors.extend(daemons.stop_problems())
    doc["wall_s"] = time.monotonic() - t_start
    doc.update(summarize(results, busy_s))
    refused = doc.get("refusal")
    if refused is not None and refused.get("error"):
        errors.append(f"refusal demonstration: {refused['error']}")
    if refused is None and not errors:
        errors.append("the refusal was not demonstrated")
    for r in results:
        errors.extend(f"request {r.index + 1} ({r.kind}, {r.pattern}): {e}" for e in r.errors)
    if doc["requested_blocks"] != doc["verified_blocks"] and not errors:
        errors.append(
            f"verified {doc['verified_blocks']} of {doc['requested_blocks']} pulled kernel blocks"
        )
    doc["failures"] = len(errors)
    doc["errors"] = errors
    doc["ok"] = not errors
    doc["per_request"] = [asdict(r) | {"ok": r.ok} for r in results]
    _print_summary(doc, results, out)
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(json_safe(doc), indent=2) + "\n")
        except OSError as exc:
            print(f"kvxferd: error: cannot write {args.json}: {exc}", file=sys.stderr)
            errors.append(f"cannot write {args.json}")
    if errors and temporary:
        print(f"daemon logs kept in {workdir}", file=out)
    elif temporary:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if not errors else 1


def _print_summary(doc: dict[str, Any], results: list[RequestResult], out: Any) -> None:
    if results:
        print("", file=out)
        print(summary_table(results), file=out)
        lat = doc["latency_ms"]
        print(
            f"\n{doc['requests_done']}/{doc['requests']} requests DONE,"
            f" {doc['verified_blocks']}/{doc['requested_blocks']} pulled kernel blocks verified"
            f" ({doc['changed_blocks']} changed by the pull),"
            f" {human_bytes(doc['bytes'])} in {doc['busy_s']:.2f}s of transfers ="
            f" {fmt(doc['throughput_gbps'])} GB/s; latency p50/p90/p99"
            f" {fmt(lat['p50'])}/{fmt(lat['p90'])}/{fmt(lat['p99'])} ms (StartPull to terminal"
            f" state on WatchTransfers); descriptors {doc['descriptors']['naive']:,} naive ->"
            f" {doc['descriptors']['posted']:,} posted",
            file=out,
        )
        if doc["preloaded_blocks"]:
            print(
                f"note: {doc['preloaded_blocks']} decode blocks already held the expected bytes"
                " before their pull (reused blocks); their write is not proven by a change",
                file=out,
            )
        if doc["ambiguous_blocks"]:
            print(
                f"note: {doc['ambiguous_blocks']} pulled blocks share their digest with another"
                " block of the same request (the fill pattern repeats), so a swap among them"
                " would not be detected",
                file=out,
            )
    refusal = doc.get("refusal")
    if refusal is not None:
        print(
            "\nrefusal (expected): decode hybrid:ppl=34 --prefix-caching pulling from"
            " prefill hybrid:ppl=66 --prefix-caching",
            file=out,
        )
        for line in refusal.get("explanation") or [f"{refusal['code']}: {refusal['message']}"]:
            print(
                textwrap.fill(line, 100, initial_indent="  ", subsequent_indent="      "), file=out
            )
    verdict = "OK" if doc["ok"] else f"FAILED ({doc['failures']} problems)"
    print(f"\nresult: {verdict}  (wall {doc['wall_s']:.1f}s)", file=out)
    for e in doc["errors"]:
        print(f"  - {e}", file=out)
