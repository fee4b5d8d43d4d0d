"""The demo's scenario: plays the scheduler and the prefill engine against one prefill/decode
pair of real daemons. Per request: allocate block IDs like an engine would, ``Hold`` on the
prefill engine socket, ``StartPull`` on the decode daemon, the terminal state from one
``WatchTransfers`` stream, then every pulled kernel block is checked with ``Checksum``
(:mod:`kvxferd.scenario.digests`): it must equal the prefill block the planner pairs it with
and must have changed from what it held before. Prefill blocks come back to the allocator when
the prefill daemon releases them (``WatchReleases``).
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvxferd.blocks import PullPlan, plan_pull
from kvxferd.errors import KvxferdError
from kvxferd.scenario.client import (
    TERMINAL,
    DaemonClient,
    Pending,
    ReleaseWatcher,
    RpcFailure,
    TransferWatcher,
    state_name,
)
from kvxferd.scenario.demo_pairs import PairConfig
from kvxferd.scenario.demo_pools import EnginePools
from kvxferd.scenario.demo_results import RequestResult, progress_text, request_line
from kvxferd.scenario.digests import any_preloaded, check_pulled, daemon_digests, zero_digest
from kvxferd.scenario.mix import Int64Array, RequestShape
from kvxferd.scenario.report import Progress
from kvxferd.v1 import scheduler_pb2

WAIT_TIMEOUT_S = 90.0
RELEASE_TIMEOUT_S = 10.0


@dataclass
class InFlight:
    result: RequestResult
    local_ids: list[Int64Array]
    plan: PullPlan
    expected: list[list[bytes]]
    before: list[list[bytes]]
    pending: Pending
    started: float


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
        self.pools = EnginePools(self.local_spec, self.remote_spec, self.rng)
        self.local_geo, self.remote_geo = self.pools.local_geo, self.pools.remote_geo
        self.zero = [zero_digest(self.local_spec, g) for g in range(len(self.local_spec.groups))]
        self.results: list[RequestResult] = []
        self.errors: list[str] = []
        self.done_requests: list[str] = []
        self.run_id = secrets.token_hex(3)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="checksum")

    def _start(
        self,
        shape: RequestShape,
        local: list[Int64Array],
        remote: list[Int64Array],
        watcher: TransferWatcher,
    ) -> InFlight | None:
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
            self.pools.free_local(local)
            self.pools.free_remote(remote)
            return None
        res.requested_blocks = sum(int(a.size) for a in plan.local_kernel_blocks)
        res.planned_nbytes = plan.nbytes
        try:
            hold = self.prefill.hold(rid, remote)
        except RpcFailure as exc:
            res.errors.append(str(exc))
            self.pools.free_local(local)
            self.pools.free_remote(remote)
            return None
        self.pools.hold(rid, remote)
        try:
            # The two daemons hash in parallel (separate processes; gRPC waits drop the GIL).
            f_expected = self._pool.submit(daemon_digests, self.prefill, plan.remote_kernel_blocks)
            before = daemon_digests(self.decode, plan.local_kernel_blocks)
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
            self.pools.free_local(local)
            return None
        if resp.status.state in TERMINAL:
            watcher.resolve(pending, resp.status, "StartPull")
        return InFlight(res, local, plan, expected, before, pending, started)

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

        for _ in range(attempts):
            if not any_preloaded(before, expected):
                break
            alt = self.pools.take_local_like(local, shape.pattern)
            if alt is None:
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
            before = daemon_digests(self.decode, plan.local_kernel_blocks)
            expected = [
                [digest_of[g][k] for k in rk.tolist()]
                for g, rk in enumerate(plan.remote_kernel_blocks)
            ]
        for ids in rejected:
            self.pools.free_local(ids)
        return local, plan, before, expected

    def _finish(self, item: InFlight, watcher: TransferWatcher) -> None:
        res = item.result
        try:
            st = watcher.wait(item.pending, WAIT_TIMEOUT_S)
        except (TimeoutError, RpcFailure) as exc:
            res.errors.append(str(exc))
            res.state = "TIMEOUT"
            self.pools.free_local(item.local_ids)
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
            self.pools.free_local(item.local_ids)
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
        self.pools.free_local(item.local_ids)

    def _verify(self, item: InFlight) -> None:
        res = item.result
        for g, lk in enumerate(item.plan.local_kernel_blocks):
            if lk.size == 0:
                continue
            rk = item.plan.remote_kernel_blocks[g]
            after = self.decode.checksum(g, lk)
            check = check_pulled(after, item.expected[g], item.before[g], self.zero[g])
            res.verified_blocks += check.verified
            res.changed_blocks += check.changed
            res.preloaded_blocks += check.preloaded
            res.ambiguous_blocks += check.ambiguous
            name = self.local_spec.groups[g].name
            if check.differ:
                pairs = ", ".join(f"{int(lk[i])}<-{int(rk[i])}" for i in check.differ[:4])
                res.errors.append(
                    f"group {name!r}: {len(check.differ)} of {lk.size} pulled kernel blocks"
                    f" differ from their prefill blocks (local<-remote: {pairs})"
                )
            if check.blank:
                res.errors.append(
                    f"group {name!r}: {len(check.blank)} prefill blocks read as never written"
                    f" (e.g. remote kernel block {int(rk[check.blank[0]])}): was --fill-pattern"
                    " applied?"
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
        inflight: deque[InFlight] = deque()
        done = 0
        while queue or inflight:
            while queue and len(inflight) < self.concurrency:
                if releases is not None:
                    self.pools.reclaim(releases.released)
                ids = self.pools.allocate(queue[0])
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
                    self.progress.update(done, progress_text(self.results), line=request_line(res))
                    self.check_alive()  # a dead daemon ends the run with its output's tail
                else:
                    inflight.append(item)
            if inflight:
                item = inflight.popleft()
                self._finish(item, watcher)
                done += 1
                self.progress.update(
                    done, progress_text(self.results), line=request_line(item.result)
                )
                if item.result.errors:
                    self.check_alive()

    def _await_releases(self, releases: ReleaseWatcher | None) -> bool:
        """Nothing in flight yet no room: wait for the prefill daemon to release held blocks;
        give blocks it never releases back by force (recording the failure)."""
        waiting = list(self.pools.held)
        if not waiting:
            return False
        missing = set(waiting)
        if releases is not None:
            missing = releases.wait(waiting, RELEASE_TIMEOUT_S)
        if releases is not None:
            self.pools.reclaim(releases.released)
        for rid in missing:
            if rid in self.pools.held:
                self.errors.append(
                    f"the prefill daemon did not release {rid} within {RELEASE_TIMEOUT_S:.0f}s"
                )
                self.pools.release_held(rid)
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
