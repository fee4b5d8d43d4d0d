"""CMA pulls: copy a pull's byte ranges out of a same-host owner's host memory with batched
``process_vm_readv`` calls, split over a small worker pool.

:meth:`CmaReader.pull` runs after the lease is confirmed (the daemon's one decision point, like
a DIRECT post). :func:`build_iovecs` takes exactly the byte ranges DIRECT would read (the
plan's ranges coalesced by :func:`kvxferd.transfer.descriptors.build_descriptors`, which checks
every local range against this daemon's registered regions and every remote range against the
owner's registered regions from its handshake, before any system call), cuts runs longer than a
batch, and lays them out as two ``struct iovec`` arrays with NumPy (no Python loop per range).
Batches of at most :data:`~kvxferd.ipc.cma.IOV_MAX` iovecs and about ``batch_bytes`` each are
taken by ``threads`` workers (``transfer.cma_threads``); ctypes releases the GIL during each
call, so the workers copy in parallel. A call that reads fewer bytes than asked (the kernel
caps one call's total, or stops at an unmapped element) is continued from where it stopped; a
call that reads nothing fails the pull with the cause.

Cancel and deadline are checked between calls: a cancelled pull ends CANCELLED, one that runs
past its deadline EXPIRED, both with every local block listed invalid. A pull whose owner
process exited during the copy fails (its pid may name another process by then). A pull
ends only once its workers' calls have returned, so a detach that awaits every pull's end
(:func:`kvxferd.daemon.quiesce.release_pool`) drops the pool's memory after the last call.

Every call runs on a worker, small pulls too: ``process_vm_readv`` takes the owner's memory-map
lock and faults the owner's pages in, so one call can block for as long as another process
holds that lock or the machine stalls (docs/vllm.md, "Tensor parallelism": one call spanned a
65 s stop). On a worker such a call holds up only its own pull, which stays TRANSFERRING until the
call returns (its bytes may still land, so the pull cannot end before that); the event loop
keeps heartbeating every other lease and answering every RPC. The hop costs about 0.1 ms.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.ranges import TransferPlan
from kvxferd.errors import Cancelled, DeadlineExceeded, KvxferdError, TransportError
from kvxferd.ipc.cma import IOV_MAX, OwnerProcess, ReadV, explain, process_vm_readv
from kvxferd.logs import kv
from kvxferd.transfer.descriptors import RegionTable, build_descriptors, split_runs
from kvxferd.transfer.state import TransferResult, TransferStatus

Int64Array = npt.NDArray[np.int64]
U64Array = npt.NDArray[np.uint64]
log = logging.getLogger(__name__)

BATCH_MIN_BYTES = 1 << 20
BATCH_MAX_BYTES = 64 << 20  # a cancel waits at most one batch per worker (~10 ms here)
BATCHES_PER_THREAD = 4


@dataclass(frozen=True)
class Iovecs:
    """A pull's ranges as paired ``struct iovec`` rows (address, length) and its batches."""

    local: U64Array  # n x 2, this process
    remote: U64Array  # n x 2, the owner's process
    batches: tuple[tuple[int, int], ...]  # [start, end) row ranges, each <= IOV_MAX rows
    runs: int  # coalesced runs before the cut (what DIRECT posts as descriptors)
    nbytes: int


def batch_bytes(nbytes: int, threads: int) -> int:
    """About :data:`BATCHES_PER_THREAD` batches per worker, within the bounds above."""
    want = nbytes // max(1, threads * BATCHES_PER_THREAD)
    return int(min(BATCH_MAX_BYTES, max(BATCH_MIN_BYTES, want)))


def build_iovecs(
    plan: TransferPlan, local: RegionTable, remote: RegionTable, *, threads: int = 1
) -> Iovecs:
    """The plan's ranges as iovec arrays, checked against both sides' registered regions
    (raises :class:`~kvxferd.errors.BlockRangeError` or ``InvalidRequest`` naming the range;
    nothing is read). A fixed number of NumPy operations, plus one step per batch."""
    loc, rem = build_descriptors(plan, local, remote)
    runs = int(loc.shape[0])
    nbytes = int(loc[:, 1].sum()) if runs else 0
    size = batch_bytes(nbytes, threads)
    _, la, ra, ln = split_runs(np.zeros(runs, np.int64), loc[:, 0], rem[:, 0], loc[:, 1], size)
    n = int(ln.size)
    liov = np.empty((n, 2), dtype=np.uint64)
    riov = np.empty((n, 2), dtype=np.uint64)
    liov[:, 0], liov[:, 1] = la, ln
    riov[:, 0], riov[:, 1] = ra, ln
    return Iovecs(liov, riov, _batches(ln, size), runs, nbytes)


def _batches(ln: Int64Array, size: int) -> tuple[tuple[int, int], ...]:
    """Row ranges of about ``size`` bytes (a row never split), at most IOV_MAX rows each."""
    if ln.size == 0:
        return ()
    starts = np.cumsum(ln) - ln
    cuts = np.flatnonzero(np.diff(starts // size)) + 1
    edges = [0, *cuts.tolist(), int(ln.size)]
    out: list[tuple[int, int]] = []
    for a, b in itertools.pairwise(edges):
        out.extend((s, min(b, s + IOV_MAX)) for s in range(a, b, IOV_MAX))
    return tuple(out)


@dataclass(frozen=True)
class CmaJob:
    """One CMA pull: which process to read, its registered regions, and by when."""

    transfer_id: str
    peer_agent: str
    peer_address: str
    owner: OwnerProcess
    remote_regions: Int64Array  # N x 3 (addr, len, dev) from the owner's handshake
    deadline: float  # monotonic


@dataclass
class _Run:
    """One pull's copy state, shared by its workers."""

    deadline: float
    owner: OwnerProcess
    next_batch: itertools.count[int] = field(default_factory=itertools.count)
    stop: TransferStatus | None = None
    error: KvxferdError | None = None
    calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def halt(self, status: TransferStatus, error: KvxferdError | None = None) -> None:
        with self.lock:
            if self.stop is None:
                self.stop, self.error = status, error


@dataclass
class CmaTimes:
    """Where the last CMA pull's time went (seconds): building and checking the iovecs, the
    copy (all calls), and the calls, batches and workers it used."""

    build: float = 0.0
    copy: float = 0.0
    calls: int = 0
    batches: int = 0
    workers: int = 0


class CmaReader:
    """Runs CMA pulls into the pool whose registered regions are ``local_rows``."""

    def __init__(
        self, local_rows: Int64Array, *, threads: int = 2, readv: ReadV = process_vm_readv
    ) -> None:
        self.local = RegionTable.from_array(local_rows)  # checked once, for the pool's life
        self.threads = max(1, threads)
        self.readv = readv
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvxferd-cma")
        self._active: dict[str, _Run] = {}
        self._remote: tuple[tuple[str, str, int], Int64Array, RegionTable] | None = None
        self.last = CmaTimes()
        self.closed = False

    def close(self) -> None:
        """Stop every copy at its next call, start no other, and let the workers go (a call
        already in the kernel still ends; its pull ends after it)."""
        self.closed = True
        for run in self._active.values():
            run.halt(TransferStatus.CANCELLED, Cancelled("this daemon's pool went away"))
        self._pool.shutdown(wait=False)

    def cancel(self, transfer_id: str) -> bool:
        """Stop a running CMA pull before its next call; False if none runs under that ID."""
        run = self._active.get(transfer_id)
        if run is None:
            return False
        run.halt(
            TransferStatus.CANCELLED,
            Cancelled(f"transfer {transfer_id} cancelled by a caller during its CMA copy"),
        )
        return True

    def _remote_table(self, job: CmaJob) -> RegionTable:
        key = job.owner.key
        if (
            self._remote is None
            or self._remote[0] != key
            or self._remote[1] is not job.remote_regions
        ):
            self._remote = (key, job.remote_regions, RegionTable.from_array(job.remote_regions))
        return self._remote[2]

    async def pull(
        self, job: CmaJob, plan: TransferPlan, local_blocks: tuple[Int64Array, ...]
    ) -> TransferResult:
        """Copy ``plan`` from the owner's process into the pool; a terminal result."""
        t0 = time.monotonic()
        run = _Run(job.deadline, job.owner)
        times = self.last = CmaTimes()
        runs, t1 = 0, 0.0
        self._active[job.transfer_id] = run
        try:
            with job.owner.use():
                iov = build_iovecs(plan, self.local, self._remote_table(job), threads=self.threads)
                runs, times.batches = iov.runs, len(iov.batches)
                t1 = time.monotonic()
                times.build = t1 - t0
                self._before(run, job)
                if run.stop is None:
                    await self._copy(run, iov, times)
                times.copy, times.calls = time.monotonic() - t1, run.calls
                if run.stop is None and job.owner.exited():
                    run.halt(TransferStatus.FAILED, _exited(job.owner.pid))
        except KvxferdError as refused:  # a range outside a registered region: nothing read
            run.halt(TransferStatus.FAILED, refused)
        finally:
            self._active.pop(job.transfer_id, None)
        status, err = run.stop or TransferStatus.DONE, run.error
        if status is TransferStatus.DONE and time.monotonic() > job.deadline:
            status = TransferStatus.EXPIRED
            err = DeadlineExceeded(
                f"the CMA copy of {plan.nbytes} bytes ended after the pull's deadline",
                fix="raise deadline_ms",
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
            posted_at=t1,  # monotonic: the ranges were built and checked, the copy started
            completed_at=t1 and t1 + times.copy,
        )

    def _before(self, run: _Run, job: CmaJob) -> None:
        if self.closed:
            run.halt(
                TransferStatus.CANCELLED,
                Cancelled(
                    "this daemon's pool went away before the CMA copy began",
                    fix="pull again once an engine has attached its pool",
                ),
            )
        elif job.owner.dropped:
            run.halt(
                TransferStatus.FAILED,
                TransportError(
                    f"peer {job.peer_address}'s process is no longer vouched for:"
                    f" {job.owner.dropped}",
                    fix="pull again: the next handshake verifies the owner's process again",
                ),
            )
        elif job.owner.exited():
            run.halt(TransferStatus.FAILED, _exited(job.owner.pid))

    async def _copy(self, run: _Run, iov: Iovecs, times: CmaTimes) -> None:
        loop = asyncio.get_running_loop()
        workers = min(self.threads, len(iov.batches))
        times.workers = workers
        futs = [
            loop.run_in_executor(self._pool, contextvars.copy_context().run, self._work, run, iov)
            for _ in range(workers)
        ]
        done = asyncio.gather(*futs)
        stopping: asyncio.CancelledError | None = None
        while not done.done():  # the workers end before this returns, even on cancellation
            try:
                await asyncio.wait((done,))
            except asyncio.CancelledError as exc:
                stopping = exc
                run.halt(TransferStatus.CANCELLED, Cancelled("the daemon stopped"))
        if stopping is not None:
            raise stopping
        done.result()

    def _work(self, run: _Run, iov: Iovecs) -> None:
        """One worker: take batches until none is left or the pull stops."""
        try:
            while run.stop is None:
                k = next(run.next_batch)
                if k >= len(iov.batches):
                    return
                a, b = iov.batches[k]
                self._batch(run, iov, a, b)
        except KvxferdError as err:
            run.halt(TransferStatus.FAILED, err)
        except OSError as err:
            what, fix = explain(err, run.owner.pid)
            run.halt(TransferStatus.FAILED, TransportError(f"CMA copy failed: {what}", fix=fix))
        except Exception as exc:  # a bug: still a terminal status, never a hung pull
            log.exception("CMA worker failed", extra=kv(pid=run.owner.pid))
            run.halt(
                TransferStatus.FAILED,
                TransportError(
                    f"CMA copy failed: {type(exc).__name__}: {exc}",
                    fix="see the daemon log; set transfer.cma = false to read over NIXL",
                ),
            )

    def _batch(self, run: _Run, iov: Iovecs, a: int, b: int) -> None:
        """Rows ``[a, b)`` with as many calls as it takes (a partial read continues where it
        stopped; the rows of one batch belong to this worker only, so it may adjust them)."""
        loc, rem = iov.local, iov.remote
        want = int(loc[a:b, 1].sum())
        while a < b:
            if run.stop is not None:
                return
            if time.monotonic() > run.deadline:
                run.halt(
                    TransferStatus.EXPIRED,
                    DeadlineExceeded(
                        "the pull's deadline passed during its CMA copy", fix="raise deadline_ms"
                    ),
                )
                return
            got = self.readv(
                run.owner.pid, loc.ctypes.data + 16 * a, rem.ctypes.data + 16 * a, b - a
            )
            with run.lock:
                run.calls += 1
            if got >= want:
                return
            if got <= 0:
                raise TransportError(
                    f"process_vm_readv of process {run.owner.pid} read nothing at"
                    f" {int(rem[a, 0]):#x} ({int(rem[a, 1])} bytes)",
                    fix="the owner's registered memory is not mapped there; set transfer.cma"
                    " = false and report it with both daemons' logs",
                )
            want -= got
            cum = np.cumsum(loc[a:b, 1])
            whole = int(np.searchsorted(cum, np.uint64(got), side="right"))
            rest = got - (int(cum[whole - 1]) if whole else 0)
            a += whole
            if rest:
                for side in (loc, rem):
                    side[a, 0] += np.uint64(rest)
                    side[a, 1] -= np.uint64(rest)


def _exited(pid: int) -> TransportError:
    return TransportError(
        f"the owner's process {pid} exited during the CMA copy; the bytes read cannot be trusted",
        fix="pull again once the owner is back (it is handshaken again)",
    )
