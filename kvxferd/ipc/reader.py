"""KERNEL pulls: copy a pull's byte ranges out of the owner's regions mapped over CUDA IPC.

:meth:`KernelReader.pull` runs after the lease is confirmed (the daemon's one decision point,
like a DIRECT post): it takes the peer generation's mappings (:mod:`.mapping`; opened once),
turns the plan's ranges into pieces (every (region, block run) coalesced as DIRECT would post
it, runs cut at one power-of-two size, :func:`piece_size`), checks every piece against the
local regions and the *mapped* sizes (:func:`kvxferd.kernels.ranges.check_groups`; both sides'
base addresses and sizes are arrays prepared once: the pool's at start, a peer generation's
when it is mapped, at handshake time through :meth:`KernelReader.prepare`), and copies them
with one kernel launch per distinct run array (``cuda/copy_ranges.cu``, copy_group: its table
is the runs once and each region's two base addresses, uploaded with it; a per-layer cache has
one) on a side stream, grid capped at ``max_ctas`` so decode keeps SMs. The host work is a fixed
number of NumPy operations over the pull's distinct runs, no Python loop per piece or region,
and never the region-by-run product (``grouped=False`` flattens it, for comparison).
Completion is a CUDA event recorded after the launch.

A small pull (:data:`INLINE_MAX_BYTES`, :data:`INLINE_MAX_RANGES`) does its host work on the
event loop and polls the event between turns of the loop (:func:`.completion.wait_event`; a
worker thread only if the copy outlasts the polls): its copy takes tens of microseconds, less
than a hop to a worker thread and back. A bigger pull does the host work, the launch and the
wait in one worker-thread call, so the loop is never blocked for long. :attr:`KernelReader.last`
keeps the last pull's cut, launch and wait times. On CPU (tests, or no CUDA build) the torch
twin copies the same pieces.

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
from kvxferd.ipc.publish import IpcPool
from kvxferd.kernels import CopyKernel, GroupCopy, RangeCopy, Regions, copy_groups, copy_ranges
from kvxferd.logs import kv
from kvxferd.pool import KVPool
from kvxferd.transfer.descriptors import run_groups, split_runs
from kvxferd.transfer.state import TransferResult, TransferStatus

Int64Array = npt.NDArray[np.int64]
log = logging.getLogger(__name__)

MAX_PIECE_BYTES = 1 << 20
MIN_PIECE_BYTES = 512
# What one more piece costs, in bytes of copy: its table row, its share of the host's NumPy
# work, its row lookups on the GPU (an estimate; it only steers the piece size).
PIECE_COST_BYTES = 16 << 10
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


@dataclass(frozen=True)
class KernelJob:
    """One KERNEL pull: which peer generation to read and by when."""

    transfer_id: str
    peer_agent: str
    peer_address: str
    key: Key  # (agent, instance_id, registration_generation) the pull was planned against
    ipc: IpcPool
    deadline: float  # monotonic


def piece_size(
    lengths: Int64Array, largest: int = MAX_PIECE_BYTES, weights: Int64Array | None = None
) -> int:
    """The power-of-two piece size (at most ``largest``) for runs of ``lengths`` bytes (run
    ``i`` counted ``weights[i]`` times, once without ``weights``): the copy kernel gives every
    piece a slot of that size (the part past a short piece's end is skipped), so the size
    minimises slots times (slot + :data:`PIECE_COST_BYTES`). Only the sizes between the
    shortest and the longest run (rounded up) are tried."""
    top = max(MIN_PIECE_BYTES, int(largest)).bit_length() - 1  # largest, rounded down
    if lengths.size == 0:
        return 1 << top
    lo = min(top, max(MIN_PIECE_BYTES.bit_length() - 1, (int(lengths.min()) - 1).bit_length()))
    hi = min(top, max(lo, (int(lengths.max()) - 1).bit_length()))
    if lo == hi:
        return 1 << lo
    ks = np.arange(lo, hi + 1, dtype=np.int64)
    per_run = (lengths[:, None] + (np.int64(1) << ks) - 1) >> ks
    slots = (per_run if weights is None else per_run * weights[:, None]).sum(axis=0)
    cost = slots * ((np.int64(1) << ks) + PIECE_COST_BYTES)
    return 1 << int(ks[int(np.argmin(cost))])


def group_pieces(
    plan: TransferPlan, piece_bytes: int = MAX_PIECE_BYTES
) -> tuple[list[GroupCopy] | RangeCopy, int]:
    """The plan's ranges as kernel pieces, and the number of (region, run) pairs before the
    cut (what DIRECT would post as descriptors): every region's ranges coalesced as DIRECT
    does, the runs cut at one power-of-two size (:func:`piece_size`, at most
    ``piece_bytes``). Regions sharing the planner's arrays (:func:`run_groups`: typically
    every layer) are coalesced, sized and cut once and kept as one :class:`GroupCopy` per
    distinct array, which the kernel repeats over the regions (``copy_group``); when regions
    share too little, one flat :class:`RangeCopy`. A fixed number of NumPy operations per
    distinct array, and no loop over pieces or regions."""
    got = run_groups(plan)
    if isinstance(got, tuple):  # little sharing: every range coalesced at once
        region, lo, ro, ln = got
        if ln.size == 0:
            return RangeCopy.empty(), 0
        return RangeCopy(*split_runs(region, lo, ro, ln, piece_size(ln, piece_bytes))), int(ln.size)
    if not got:
        return [], 0
    runs = sum(g.length.size * g.regions.size for g in got)
    if len(got) == 1:  # one weight for every run: it cannot change the cheapest size
        size = piece_size(got[0].length, piece_bytes)
    else:
        lengths = np.concatenate([g.length for g in got])
        weights = np.concatenate([np.full(g.length.size, g.regions.size) for g in got])
        size = piece_size(lengths, piece_bytes, weights.astype(np.int64))
    out = []
    for g in got:
        zeros = np.zeros(g.length.size, dtype=np.int64)
        _, lo, ro, ln = split_runs(zeros, g.local_offset, g.remote_offset, g.length, size)
        out.append(GroupCopy(g.regions, lo, ro, ln))
    return out, runs


def pieces(plan: TransferPlan, piece_bytes: int = MAX_PIECE_BYTES) -> tuple[RangeCopy, int]:
    """:func:`group_pieces` flattened: one piece per (region, cut run)."""
    got, runs = group_pieces(plan, piece_bytes)
    if isinstance(got, RangeCopy):
        return got, runs
    return RangeCopy.concat([g.flat() for g in got]), runs


def distinct_ranges(plan: TransferPlan) -> int:
    """The plan's ranges with the arrays regions share counted once: the grouped copy's host
    work (:func:`group_pieces`) handles each shared array once."""
    seen: dict[tuple[int, int, int], int] = {}
    for rr in plan.ranges:
        seen[id(rr.local_offset), id(rr.remote_offset), id(rr.length)] = rr.num_ranges
    return sum(seen.values())


def region_bytes(pool: KVPool) -> list[torch.Tensor]:
    """Each region of ``pool`` as a 1-D uint8 tensor over exactly its registered bytes."""
    out = []
    for r, m in zip(pool.spec.regions, pool.memory, strict=True):
        t = pool.tensors[r.name]
        storage = torch.empty(0, dtype=torch.uint8, device=t.device)
        offset = t.storage_offset() * t.element_size()
        out.append(storage.set_(t.untyped_storage(), offset, (m.nbytes,), (1,)))
    return out


@dataclass
class PullTimes:
    """Where the last KERNEL pull's time went (seconds): cutting the plan into pieces, the
    launch (every piece checked against both sides' regions, the address table, its upload and
    the kernel launch), the wait for the copy's event, and the whole pull seen from the event
    loop (the rest of it is the thread hop, or the loop's turns between polls). ``inline``: the
    host work ran on the loop; ``polls``: the loop turns it yielded while polling the event;
    ``thread_wait``: the polls ran out and the wait ended in a worker thread."""

    cut: float = 0.0
    launch: float = 0.0
    wait: float = 0.0
    call: float = 0.0
    pieces: int = 0
    inline: bool = False
    polls: int = 0
    thread_wait: bool = False


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

    async def pull(
        self, job: KernelJob, plan: TransferPlan, local_blocks: tuple[Int64Array, ...]
    ) -> TransferResult:
        """Copy ``plan`` from the peer into the pool; a terminal :class:`TransferResult`."""
        t0 = time.monotonic()
        status, runs = TransferStatus.DONE, 0
        err: KvxferdError | None = None
        times = self.last = PullTimes(inline=self.inline(plan))
        try:
            maps = self.cache.get(job.key, job.ipc)
            with maps.use() as src:
                # copy_ranges checks every piece against the local regions and the *mapped*
                # sizes before anything is launched (kvxferd.kernels.ranges.check_ranges).
                # Both paths return only once the copy has ended, even if this task is
                # cancelled meanwhile: the mappings must outlive the copy.
                regions = self._regions(maps, src)
                if times.inline:
                    self.backend, runs = await self._copy_inline(regions, plan, times)
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
        self, src: Regions, plan: TransferPlan, times: PullTimes
    ) -> tuple[str, int]:
        """Pieces, checks and the launch on the loop; the event polled between turns of it."""
        ran, runs, done = self._launch(src, plan, times)
        if done is not None:
            t = time.perf_counter()
            waited = await wait_event(done)
            times.wait = time.perf_counter() - t
            times.polls, times.thread_wait = waited.polls, waited.thread
        return ran, runs

    def _copy(self, src: Regions, plan: TransferPlan, times: PullTimes) -> tuple[str, int]:
        """Pieces, checks, the launch and the wait for its event (worker thread)."""
        ran, runs, done = self._launch(src, plan, times)
        if done is not None:
            t = time.perf_counter()
            done.synchronize()
            times.wait = time.perf_counter() - t
        return ran, runs

    def _run(self, src: Regions, rc: list[GroupCopy] | RangeCopy) -> str:
        if isinstance(rc, RangeCopy):
            return copy_ranges(self.local, src, rc, max_ctas=self.max_ctas, kernel=self.kernel)
        return copy_groups(self.local, src, rc, max_ctas=self.max_ctas)

    def _launch(
        self, src: Regions, plan: TransferPlan, times: PullTimes
    ) -> tuple[str, int, torch.cuda.Event | None]:
        """Pieces, checks and one launch followed by its completion event (none on CPU: the
        twin has copied when it returns). Returns which implementation ran, the run count and
        the event."""
        t0 = time.perf_counter()
        rc, runs = (group_pieces if self.grouped else pieces)(plan, self.piece_bytes)
        t1 = time.perf_counter()
        times.cut = t1 - t0
        times.pieces = rc.pieces if isinstance(rc, RangeCopy) else sum(g.pieces for g in rc)
        if self._stream is None:
            ran = self._run(src, rc)
            times.launch = time.perf_counter() - t1
            return ran, runs, None
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            # copy_ranges / copy_groups check every piece against both sides before they
            # launch anything.
            ran = self._run(src, rc)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._stream)
        times.launch = time.perf_counter() - t1
        return ran, runs, done
