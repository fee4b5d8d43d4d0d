"""KERNEL pulls inline on the event loop or in a worker thread (CPU twin), and the event wait
they use (:mod:`kvxferd.ipc.completion`, with fake events): a small pull does its work on the
loop, a big one in a thread, both copy the right bytes; an event is polled between turns of
the loop and waited on in a thread once the polls run out; a cancellation never ends a wait (or
a pull's use of its mappings) before the copy has."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from kvxferd.blocks import plan_pull
from kvxferd.ipc import reader as reader_module
from kvxferd.ipc.completion import settle, wait_event
from kvxferd.ipc.mapping import MappingCache
from kvxferd.ipc.publish import IpcPool
from kvxferd.ipc.reader import KernelJob, KernelReader, PullTimes
from kvxferd.layout.presets import preset
from kvxferd.pool import KVPool
from kvxferd.transfer.state import TransferStatus
from tests.ipc.fakes import FakeHost, export_pool, ordinal_of

SPEC = "dense:num_blocks=64,num_layers=3,num_kv_heads=2,head_size=16,block_size=4"
KEY = ("owner-agent", "i1", 1)


def _setup() -> tuple[KVPool, KVPool, KernelReader, IpcPool]:
    spec = preset(SPEC)
    owner, pool = KVPool.allocate(spec), KVPool.allocate(spec)
    owner.fill_pattern(0, list(range(spec.num_kernel_blocks(0))), seed=3)
    pool.fill_pattern(0, list(range(spec.num_kernel_blocks(0))), seed=9)
    host = FakeHost()
    ipc = export_pool(host, owner, "own")
    cache = MappingCache(device=0, opener=host.open, ordinal_of=ordinal_of)
    return owner, pool, KernelReader(pool, cache, max_ctas=4, piece_bytes=1 << 10), ipc


def _job(ipc: IpcPool) -> KernelJob:
    return KernelJob("t1", KEY[0], "127.0.0.1:1", KEY, ipc, time.monotonic() + 30)


class _Spy:
    """Records the thread each launch ran on."""

    def __init__(self, reader: KernelReader) -> None:
        self.threads: list[int] = []
        self._launch = reader._launch

    def __call__(self, *args: object) -> object:
        self.threads.append(threading.get_ident())
        return self._launch(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("inline", [True, False])
def test_small_pulls_run_on_the_loop_and_big_ones_in_a_thread(
    inline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner, pool, reader, ipc = _setup()
    plan = plan_pull(owner.spec, owner.spec, [[1, 2, 7]], [[3, 5, 60]], prefix_caching=False)
    part = plan.per_rank[0]
    assert 0 < part.nbytes <= reader_module.INLINE_MAX_BYTES
    if not inline:  # the same pull, above the threshold
        monkeypatch.setattr(reader_module, "INLINE_MAX_BYTES", part.nbytes - 1)
    spy = _Spy(reader)
    monkeypatch.setattr(reader, "_launch", spy)
    loop_thread: list[int] = []

    async def run() -> TransferStatus:
        loop_thread.append(threading.get_ident())
        result = await reader.pull(_job(ipc), part, plan.local_kernel_blocks)
        return result.status

    assert asyncio.run(run()) is TransferStatus.DONE
    assert (spy.threads == loop_thread) is inline and len(spy.threads) == 1
    last = reader.last
    assert last.inline is inline and last.pieces > 0 and last.cut > 0 and last.launch > 0
    assert last.call >= last.cut + last.launch and not last.thread_wait
    assert pool.checksums(0, [1, 2, 7]) == owner.checksums(0, [3, 5, 60])
    fresh = KVPool.allocate(owner.spec)
    fresh.fill_pattern(0, [0, 3, 63], seed=9)
    assert pool.checksums(0, [0, 3, 63]) == fresh.checksums(0, [0, 3, 63])  # untouched


def test_the_range_count_also_bounds_inline_pulls(monkeypatch: pytest.MonkeyPatch) -> None:
    owner, pool, reader, _ = _setup()
    part = plan_pull(owner.spec, owner.spec, [[1, 2]], [[3, 5]], prefix_caching=False).per_rank[0]
    distinct = reader_module.distinct_ranges(part)
    assert 0 < distinct < part.num_ranges  # every layer shares the planner's arrays
    assert reader.inline(part)
    # Grouped (the default), the host handles the shared ranges once: they are what counts.
    monkeypatch.setattr(reader_module, "INLINE_MAX_RANGES", distinct)
    assert reader.inline(part)
    flat = KernelReader(pool, reader.cache, max_ctas=4, grouped=False)
    assert not flat.inline(part)  # flattened, it handles every range
    monkeypatch.setattr(reader_module, "INLINE_MAX_RANGES", distinct - 1)
    assert not reader.inline(part)


class FakeEvent:
    """Fires at the ``fire_at``-th ``query()`` (never, for 0) or when ``synchronize()`` ends;
    ``synchronize()`` first waits for ``release`` (set, unless a test clears it)."""

    def __init__(self, fire_at: int = 0) -> None:
        self.fire_at = fire_at
        self.queries = 0
        self.fired = False
        self.sync_threads: list[int] = []
        self.release = threading.Event()
        self.release.set()

    def query(self) -> bool:
        self.queries += 1
        if self.fire_at and self.queries >= self.fire_at:
            self.fired = True
        return self.fired

    def synchronize(self) -> None:
        self.sync_threads.append(threading.get_ident())
        assert self.release.wait(10)
        self.fired = True


def test_an_event_is_polled_between_turns_of_the_loop() -> None:
    event = FakeEvent(fire_at=5)
    turns = 0

    async def other() -> None:
        nonlocal turns
        while not event.fired:
            turns += 1
            await asyncio.sleep(0)

    async def run() -> None:
        side = asyncio.get_running_loop().create_task(other())
        await asyncio.sleep(0)
        waited = await wait_event(event, limit_s=10)
        assert waited.polls == 4 and not waited.thread
        await side

    asyncio.run(run())
    assert event.queries == 5 and event.sync_threads == []
    assert turns >= 4  # the loop ran other work between the polls


def test_an_event_that_outlasts_the_polls_is_waited_on_in_a_thread() -> None:
    event = FakeEvent()  # query() never says True

    async def run() -> None:
        t0 = time.monotonic()
        waited = await wait_event(event, limit_s=0.005)
        assert waited.thread and waited.polls > 0 and time.monotonic() - t0 >= 0.005

    asyncio.run(run())
    assert event.fired and len(event.sync_threads) == 1
    assert event.sync_threads[0] != threading.get_ident()


@pytest.mark.parametrize("thread", [False, True])
def test_a_cancelled_wait_ends_only_when_the_event_has_fired(thread: bool) -> None:
    event = FakeEvent(fire_at=0 if thread else 50)
    event.release.clear()

    async def run() -> None:
        task = asyncio.get_running_loop().create_task(
            wait_event(event, limit_s=0.001 if thread else 10)
        )
        while not (event.sync_threads if thread else event.queries >= 10):
            await asyncio.sleep(0.001 if thread else 0)
        task.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done()  # still waiting for the copy
        event.release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert event.fired

    asyncio.run(run())


def test_settle_returns_the_result_and_holds_a_cancellation_until_done() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        assert await settle(loop.run_in_executor(None, lambda: 7)) == 7
        fut: asyncio.Future[int] = loop.create_future()
        task = loop.create_task(settle(fut))
        await asyncio.sleep(0)
        task.cancel()
        task.cancel()  # twice: still one wait
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done() and not fut.cancelled()
        fut.set_result(1)
        with pytest.raises(asyncio.CancelledError):
            await task
        failed: asyncio.Future[int] = loop.create_future()
        failed.set_exception(ValueError("boom"))
        with pytest.raises(ValueError, match="boom"):
            await settle(failed)

    asyncio.run(run())


def test_a_cancelled_pull_keeps_its_mappings_until_the_copy_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The thread path: the task is cancelled while the worker copies; the mappings stay in use
    until the worker returns, then the cancellation is raised."""
    owner, pool, reader, ipc = _setup()
    part = plan_pull(owner.spec, owner.spec, [[1]], [[3]], prefix_caching=False).per_rank[0]
    monkeypatch.setattr(reader_module, "INLINE_MAX_BYTES", 0)
    started, release = threading.Event(), threading.Event()
    copy = reader._copy

    def slow_copy(*args: object) -> tuple[str, int]:
        started.set()
        assert release.wait(10)
        return copy(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(reader, "_copy", slow_copy)

    async def run() -> None:
        task = asyncio.get_running_loop().create_task(
            reader.pull(_job(ipc), part, (np.array([1]),))
        )
        while not started.is_set():
            await asyncio.sleep(0.001)
        maps = reader.cache.current(KEY[0])
        assert maps is not None and maps.users == 1
        task.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done() and maps.users == 1  # the copy still runs: mappings in use
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert maps.users == 0

    asyncio.run(run())
    assert pool.checksums(0, [1]) == owner.checksums(0, [3])  # the copy ran to its end


def test_pull_times_default_to_the_thread_path() -> None:
    times = PullTimes()
    assert not times.inline and times.polls == 0 and not times.thread_wait


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("cycles", [0, 50_000_000])
def test_a_cuda_event_is_waited_on_the_loop(cycles: int) -> None:
    """A real CUDA event: a short stream's event is polled to its end on the loop; a long one
    (a ~25-50 ms spin kernel) outlasts the polls and ends in a thread; either way it has fired."""
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        if cycles:
            torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)

    async def run() -> None:
        waited = await wait_event(event, limit_s=0.005)
        assert waited.thread is bool(cycles)

    asyncio.run(run())
    assert event.query()  # type: ignore[no-untyped-call]
