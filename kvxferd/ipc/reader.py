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
(``grouped=False`` flattens it, for comparison). Completion is a CUDA event recorded after
the launch.

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
import contextvars
import functools
import logging
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvxferd.blocks.ranges import TransferPlan
from kvxferd.errors import DeadlineExceeded, KvxferdError, TransportError
from kvxferd.ipc.completion import settle, wait_event
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


@dataclass(frozen=True)
class KernelJob:
    """One KERNEL pull: which peer generation to read and by when."""

    transfer_id: str
    peer_agent: str
    peer_address: str
    key: Key  # (agent, instance_id, registration_generation) the pull was planned against
    ipc: IpcPool
    deadline: float  # monotonic


def region_bytes(pool: KVPool) -> list[torch.Tensor]:
    """Each region of ``pool`` as a 1-D uint8 tensor over exactly its registered bytes."""
    out = []
    for r, m in zip(pool.spec.regions, pool.memory, strict=True):
        t = pool.tensors[r.name]
        storage = torch.empty(0, dtype=torch.uint8, device=t.device)
        offset = t.storage_offset() * t.element_size()
        out.append(storage.set_(t.untyped_storage(), offset, (m.nbytes,), (1,)))
    return out


@dataclass(frozen=True, eq=False)
class ReadyPull:
    """A KERNEL pull's host work, done before its lease is confirmed (:meth:`KernelReader.ready`):
    the plan cut into pieces, checked against both sides and its launch tables built, for the
    peer generation's mappings ``maps``. A pull of that plan from those same mappings only
    launches; any other redoes the work (the regions it was checked against are gone)."""

    plan: TransferPlan
    maps: PeerMaps
    copy: CheckedCopy
    runs: int
    cut: float  # seconds: the pieces cut
    check: float  # seconds: checked and the tables built


@dataclass
class PullTimes:
    """Where the last KERNEL pull's time went (seconds): cutting the plan into pieces, the
    launch (every piece checked against both sides' regions and the launch tables built, unless
    that was done before the confirmation, then the tables' upload and the kernel launch), the
    wait for the copy's event, and the whole pull seen from the event loop (the rest of it is
    the thread hop, or the loop's turns between polls). ``inline``: the host work ran on the
    loop; ``polls``: the loop turns it yielded while polling the event; ``thread_wait``: the
    polls ran out and the wait ended in a worker thread; ``ready``: cut and check ran before
    the confirmation (:class:`ReadyPull`; ``cut`` and ``check`` are then its times)."""

    cut: float = 0.0
    launch: float = 0.0
    wait: float = 0.0
    call: float = 0.0
    pieces: int = 0
    inline: bool = False
    polls: int = 0
    thread_wait: bool = False
    check: float = 0.0  # the pieces checked and the tables built (part of launch before)
    ready: bool = False  # cut and check were done before the confirmation (ReadyPull)


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
        except KvxferdError:
            return None
        return ReadyPull(plan, maps, copy, runs, t1 - t0, t2 - t1)

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
            maps = self.cache.get(job.key, job.ipc)
            with maps.use() as src:
                # Every piece is checked against the local regions and the *mapped* sizes
                # before anything is launched (kvxferd.kernels.ranges.check_copy), here or
                # in ready(). Both paths return only once the copy has ended, even if this
                # task is cancelled meanwhile: the mappings must outlive the copy.
                regions = self._regions(maps, src)
                if ready is not None and (ready.maps is not maps or ready.plan is not plan):
                    ready = None  # prepared against another generation's mappings
                if times.inline:
                    self.backend, runs = await self._copy_inline(regions, plan, times, ready)
                else:
                    loop = asyncio.get_running_loop()
                    call = functools.partial(self._copy, regions, plan, times)
                    ctx = contextvars.copy_context()
                    self.backend, runs = await settle(loop.run_in_executor(None, ctx.run, call))
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
