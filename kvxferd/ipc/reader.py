"""KERNEL pulls: copy a pull's byte ranges out of the owner's regions mapped over CUDA IPC.

A pull's host work comes first: the peer generation's mappings (:mod:`.mapping`; opened once),
the plan's ranges cut into pieces (:mod:`.pieces`: coalesced as DIRECT would post them, cut at
one power-of-two size, kept per array the regions share), every piece checked against the
local regions and the *mapped* sizes (:func:`kvxferd.kernels.prepare_copy`; both sides' base
addresses and sizes are arrays prepared once: the pool's at start, a peer generation's when it
is mapped, at handshake time through :meth:`KernelReader.prepare`) and the launch tables built.
The daemon does it while the pull's lease confirmation is in flight (:meth:`KernelReader.ready`),
so that once the confirmation succeeded (the daemon's one decision point, like a DIRECT post)
:meth:`KernelReader.pull` only launches: one kernel per distinct run array
(``cuda/copy_ranges.cu``, copy_group: its table is the runs once and each region's two base
addresses; a per-layer cache has one) on a side stream, grid capped at ``max_ctas`` so decode
keeps SMs. A pull whose mappings changed meanwhile (the confirmation found a new generation)
does the host work again. The host work is a fixed number of NumPy operations over the pull's
distinct runs, no Python loop per piece or region, and never the region-by-run product
(``grouped=False`` flattens it, for comparison). Completion is a CUDA event after the launch.

With the gates (:mod:`.armed`) the copy made ready is launched then too, behind a closed gate
the daemon opens at the decision point (:meth:`KernelReader.release`) or aborts
(:meth:`KernelReader.disarm`); :meth:`KernelReader.pull` then only waits for it.

A small pull (:data:`INLINE_MAX_BYTES`, :data:`INLINE_MAX_RANGES`) runs on the event loop and
polls the event between turns of the loop (:func:`.completion.wait_event`; a worker thread
only if the copy outlasts the polls): its copy takes tens of microseconds, less than a hop to a
worker thread and back. A bigger pull does the host work, the launch and the wait in one
worker-thread call, so the loop is never blocked for long. :attr:`KernelReader.last` keeps the
last pull's cut, check, launch and wait times. On CPU (tests, or no CUDA build) the torch twin
copies the same pieces.

A running copy cannot be interrupted: cancel and deadline take effect when it ends (it moves a
pull's bytes at memory speed, milliseconds), and a copy that ends after the deadline is
EXPIRED with every local block listed invalid. The mappings it uses stay open until it ends,
even if the peer's set is dropped meanwhile or the pull's task is cancelled (the cancellation
is raised once the copy has ended: :func:`.completion.settle`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import time

import numpy as np
import numpy.typing as npt
import torch

from kvxferd.blocks.ranges import TransferPlan
from kvxferd.errors import DeadlineExceeded, KvxferdError, TransportError
from kvxferd.ipc.armed import Armed, ArmedState, GateSlots, gate_slots
from kvxferd.ipc.completion import settle, wait_event
from kvxferd.ipc.kernel_job import KernelJob, PullTimes, ReadyPull, region_bytes
from kvxferd.ipc.mapping import Key, MappingCache, PeerMaps
from kvxferd.ipc.pieces import MAX_PIECE_BYTES, distinct_ranges, group_pieces, pieces
from kvxferd.ipc.publish import IpcPool
from kvxferd.kernels import (
    CheckedCopy,
    CopyKernel,
    GroupCopy,
    RangeCopy,
    Regions,
    prepare_copy,
    run_copy,
)
from kvxferd.logs import kv
from kvxferd.pool import KVPool
from kvxferd.transfer.state import TransferResult, TransferStatus

Int64Array = npt.NDArray[np.int64]
log = logging.getLogger(__name__)

# Pulls up to this many bytes run inline on the event loop (host work, launch, event polled;
# KernelReader.pull). On an H100 the grouped copy reads 1 GiB of random 64 KiB blocks over CUDA
# IPC in ~0.76 ms, within the polls' bound (completion.POLL_LIMIT_S; a slower copy moves its
# wait to a thread there), and its host work is ~0.35 ms (cut 0.14, launch 0.21): less than
# the worker-thread hop it saves (~0.3 ms), and short enough to hold the loop for
# (docs/benchmarks.md, "Session 9").
INLINE_MAX_BYTES = 1 << 30
# ... and at most this many ranges the host handles: the host work grows with them, not with
# the bytes. Grouped (the default), the distinct ranges (shared arrays counted once: 512 for
# 1 GiB of random blocks of a per-layer cache); flattened, every range (16,384 there; cut +
# launch ~0.75 ms on the same host).
INLINE_MAX_RANGES = 8192
# Completion events a reader keeps for reuse (KernelReader._spare): as many as pulls commonly
# copy at once.
SPARE_EVENTS = 8


class KernelReader:
    """Runs KERNEL pulls into ``pool`` from peers mapped in ``cache``."""

    def __init__(
        self,
        pool: KVPool,
        cache: MappingCache,
        *,
        max_ctas: int = 0,
        piece_bytes: int = MAX_PIECE_BYTES,
        kernel: CopyKernel = CopyKernel.STRIDE,
        grouped: bool = True,
        armed: bool = True,
    ) -> None:
        self.pool = pool
        # Pieces kept per shared array (copy_group), which only the stride kernel runs; else
        # flattened.
        self.grouped = grouped and kernel is CopyKernel.STRIDE
        self.cache = cache
        self.max_ctas = max_ctas
        self.piece_bytes = piece_bytes
        self.kernel = kernel
        self.local = Regions.of("dst", region_bytes(pool))  # checked once, for the pool's life
        self.device = self.local.device
        self._stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        # Completion events whose copy has ended and been seen, for the next launches: a fresh
        # torch.cuda.Event costs its creation and, at its first record, a CUDA event's.
        self._events: list[torch.cuda.Event] = []
        self._src: tuple[PeerMaps, Regions] | None = None  # the last peer generation's regions
        self._sweeper: asyncio.Task[None] | None = None
        # Launches armed before the confirmation (kvxferd.ipc.armed): grouped copies only.
        self._gates: GateSlots | None = None
        if self.grouped and armed:
            self._gates = gate_slots(self.device)
        self.backend = ""  # which implementation ran last ("cuda" or "torch")
        self.last = PullTimes()

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Drop idle mappings periodically (call on the event loop)."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        period = max(0.05, self.cache.idle_s / 2)
        while True:
            await asyncio.sleep(period)
            self.cache.sweep()

    def close(self, why: str = "this daemon's pool went away") -> None:
        """Stop sweeping and drop every mapping (each closes once no copy uses it)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._src = None
        if self._gates is not None:
            self._gates.close()  # every armed launch aborted and ended before the unmapping
        self.cache.close(why)

    def prepare(self, key: Key, ipc: IpcPool) -> str | None:
        """Open the peer generation's mappings and check its regions now (once, at handshake
        time); why not, when they cannot be."""
        try:
            maps = self.cache.get(key, ipc)
            if self._src is not None and self._src[0] is maps and not maps.closed:
                return None  # opened and checked already (every pull asks)
            with maps.use() as src:
                self._regions(maps, src)
        except KvxferdError as err:
            return err.message
        return None

    def forget(self, agent: str, why: str) -> bool:
        return self.cache.forget(agent, why)

    def _regions(self, maps: PeerMaps, src: list[torch.Tensor]) -> Regions:
        """The mapped regions of ``maps`` as checked :class:`Regions` (built once per set)."""
        if self._src is None or self._src[0] is not maps:
            self._src = (maps, Regions.of("src", src))
        return self._src[1]

    # -- pulls ----------------------------------------------------------------------------------

    def ready(self, key: Key, ipc: IpcPool, plan: TransferPlan) -> ReadyPull | None:
        """Do a pull's host work ahead (call before its lease is confirmed, while the
        confirmation is in flight): the pieces cut and checked against the peer generation's
        mapped regions, the launch tables built; :meth:`pull` then only launches. None when
        the pull is too big to run inline (its host work stays in the worker thread) or
        cannot be prepared (the pull redoes it, and fails with why)."""
        if not self.inline(plan):
            return None
        try:
            maps = self.cache.get(key, ipc)
            with maps.use() as src:
                t0 = time.perf_counter()
                rc, runs = self._pieces(plan)
                t1 = time.perf_counter()
                copy = prepare_copy(self.local, self._regions(maps, src), rc)
                t2 = time.perf_counter()
                armed = self._arm(maps, copy)
        except KvxferdError:
            return None
        return ReadyPull(plan, maps, copy, runs, t1 - t0, t2 - t1, armed)

    def _arm(self, maps: PeerMaps, copy: CheckedCopy) -> Armed | None:
        """Launch ``copy`` behind a closed gate, holding ``maps`` open until it ended; None
        when there are no gates or no free slot (it launches after the confirmation)."""
        if self._gates is None:
            return None
        hold = contextlib.ExitStack()
        hold.enter_context(maps.use())
        armed = self._gates.arm(copy, self.max_ctas, hold)
        if armed is None:
            hold.close()
        return armed

    def release(self, ready: ReadyPull, key: Key) -> None:
        """The pull of ``ready`` passed its decision point (its lease confirmed, not
        cancelled), confirmed against the owner's generation ``key``: open its armed copy's
        gate if the copy was built for that generation's mappings, else abort it (the pull
        then copies from the mappings of ``key``)."""
        if ready.armed is None:
            return
        if ready.maps.key == key and not ready.maps.dropped:
            ready.armed.open()
        else:
            self.disarm(ready)

    def disarm(self, ready: ReadyPull) -> None:
        """Make sure ``ready``'s armed copy ends: aborted unless its gate opened, its slot and
        mappings given back once it ended (call on every path of a pull that armed; a no-op
        once :meth:`pull` waited for it)."""
        if ready.armed is not None and self._gates is not None:
            self._gates.reap(ready.armed)

    async def pull(
        self,
        job: KernelJob,
        plan: TransferPlan,
        local_blocks: tuple[Int64Array, ...],
        ready: ReadyPull | None = None,
    ) -> TransferResult:
        """Copy ``plan`` from the peer into the pool; a terminal :class:`TransferResult`.
        ``ready``: its host work done ahead (:meth:`ready`), used when it was done for this
        plan against the mappings the pull reads."""
        t0 = time.monotonic()
        status, runs = TransferStatus.DONE, 0
        err: KvxferdError | None = None
        # Work made ready for this plan was made because it runs inline.
        inline = (ready is not None and ready.plan is plan) or self.inline(plan)
        times = self.last = PullTimes(inline=inline)
        try:
            ran = await self._armed_copy(ready, plan, times) if ready is not None else None
            if ran is not None:
                self.backend, runs = ran
            else:
                self.backend, runs = await self._copy_now(job, plan, times, ready)
            times.call = time.monotonic() - t0
            if time.monotonic() > job.deadline:
                status = TransferStatus.EXPIRED
                err = DeadlineExceeded(
                    f"the kernel copy of {plan.nbytes} bytes ended after the pull's deadline",
                    fix="raise deadline_ms",
                )
        except KvxferdError as exc:
            status, err = TransferStatus.FAILED, exc
        except Exception as exc:  # torch or CUDA: still a terminal status
            log.exception("kernel pull failed", extra=kv(transfer_id=job.transfer_id))
            status = TransferStatus.FAILED
            err = TransportError(
                f"kernel pull failed: {type(exc).__name__}: {exc}",
                fix="see the daemon log; retry with transfer.strategy = direct",
            )
        return TransferResult.ended(
            job.transfer_id,
            job.peer_agent,
            status,
            err,
            local_blocks,
            nbytes=plan.nbytes,
            descriptors=runs,
            elapsed_s=time.monotonic() - t0,
        )

    async def _armed_copy(
        self, ready: ReadyPull, plan: TransferPlan, times: PullTimes
    ) -> tuple[str, int] | None:
        """Wait for ``ready``'s armed copy if its gate opened (:meth:`release`; one never
        released is aborted); which ran and the run count, or None when there is none to wait
        for or its arming failed (the pull copies again: what ran wrote the same bytes)."""
        armed = ready.armed
        if armed is not None and armed.state is ArmedState.ARMED:
            self.disarm(ready)  # never released: this pull launches its copy itself
        if armed is None or armed.state is not ArmedState.OPEN or self._gates is None:
            return None
        t = time.perf_counter()
        waited = await wait_event(armed)  # never leaves before the copy ended
        times.wait = time.perf_counter() - t
        times.polls, times.thread_wait = waited.polls, waited.thread
        times.cut, times.check, times.ready, times.armed = ready.cut, ready.check, True, True
        times.pieces = ready.copy.pieces
        error = armed.error
        self._gates.finish(armed)
        if error:
            log.warning("an armed kernel launch failed; copying again", extra=kv(error=error))
            return None
        if ready.plan is not plan:  # armed for another plan than this pull's: copy this one
            return None
        return ("cuda" if ready.copy.cuda else "torch"), ready.runs

    async def _copy_now(
        self, job: KernelJob, plan: TransferPlan, times: PullTimes, ready: ReadyPull | None
    ) -> tuple[str, int]:
        """The copy launched now: host work unless ``ready`` has it, the launch, the wait."""
        maps = self.cache.get(job.key, job.ipc)
        with maps.use() as src:
            # Every piece is checked against both sides' regions (the *mapped* sizes) before
            # any launch, here or in ready(); both paths return only once the copy ended, even
            # if this task is cancelled meanwhile: the mappings must outlive the copy.
            regions = self._regions(maps, src)
            if ready is not None and (ready.maps is not maps or ready.plan is not plan):
                ready = None  # prepared against another generation's mappings
            if times.inline:
                return await self._copy_inline(regions, plan, times, ready)
            loop = asyncio.get_running_loop()
            call = functools.partial(self._copy, regions, plan, times)
            ctx = contextvars.copy_context()
            return await settle(loop.run_in_executor(None, ctx.run, call))

    def inline(self, plan: TransferPlan) -> bool:
        """Whether ``plan`` is small enough to run on the event loop (:data:`INLINE_MAX_BYTES`,
        :data:`INLINE_MAX_RANGES`, counted as this reader's host work sees them)."""
        if plan.nbytes > INLINE_MAX_BYTES:
            return False
        if self.grouped:
            return distinct_ranges(plan) <= INLINE_MAX_RANGES
        return plan.num_ranges <= INLINE_MAX_RANGES

    async def _copy_inline(
        self, src: Regions, plan: TransferPlan, times: PullTimes, ready: ReadyPull | None
    ) -> tuple[str, int]:
        """Pieces, checks (unless ``ready``) and the launch on the loop; the event polled
        between turns of it."""
        ran, runs, done = self._launch(src, plan, times, ready)
        if done is not None:
            t = time.perf_counter()
            waited = await wait_event(done)
            times.wait = time.perf_counter() - t
            times.polls, times.thread_wait = waited.polls, waited.thread
            self._spare(done)
        return ran, runs

    def _copy(self, src: Regions, plan: TransferPlan, times: PullTimes) -> tuple[str, int]:
        """Pieces, checks, the launch and the wait for its event (worker thread)."""
        ran, runs, done = self._launch(src, plan, times, None)
        if done is not None:
            t = time.perf_counter()
            done.synchronize()
            times.wait = time.perf_counter() - t
            self._spare(done)
        return ran, runs

    def _spare(self, done: torch.cuda.Event) -> None:
        """Keep ``done`` (its copy has ended and was seen to) for a later launch; at most
        :data:`SPARE_EVENTS` are kept (a list's append and pop are atomic: the worker-thread
        path returns its event from another thread)."""
        if len(self._events) < SPARE_EVENTS:
            self._events.append(done)

    def _pieces(self, plan: TransferPlan) -> tuple[list[GroupCopy] | RangeCopy, int]:
        return (group_pieces if self.grouped else pieces)(plan, self.piece_bytes)

    def _launch(
        self, src: Regions, plan: TransferPlan, times: PullTimes, ready: ReadyPull | None
    ) -> tuple[str, int, torch.cuda.Event | None]:
        """Pieces and checks (unless ``ready`` has them), then one launch per table followed
        by its completion event (none on CPU: the twin has copied when it returns). Returns
        which implementation ran, the run count and the event."""
        t0 = time.perf_counter()
        if ready is None:
            rc, runs = self._pieces(plan)
            t1 = time.perf_counter()
            copy = prepare_copy(self.local, src, rc)
            times.cut, times.check = t1 - t0, time.perf_counter() - t1
        else:
            copy, runs, t1 = ready.copy, ready.runs, t0
            times.cut, times.check, times.ready = ready.cut, ready.check, True
        times.pieces = copy.pieces
        if self._stream is None:
            ran = run_copy(copy, max_ctas=self.max_ctas, kernel=self.kernel)
            times.launch = time.perf_counter() - t1
            return ran, runs, None
        # The stream goes with the call: no device or stream context to enter (~0.04 ms).
        ran = run_copy(
            copy, max_ctas=self.max_ctas, kernel=self.kernel, stream=self._stream.cuda_stream
        )
        try:
            done = self._events.pop()
        except IndexError:
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(self._stream)
        times.launch = time.perf_counter() - t1
        return ran, runs, done


__all__ = ["KernelJob", "KernelReader", "PullTimes", "ReadyPull", "region_bytes"]
