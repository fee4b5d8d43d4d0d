"""KERNEL on a GPU: the range-copy kernel against the torch twin on owned memory and on memory
imported over CUDA IPC from another process, bounds refusals, a restarted owner's mappings
dropped, and pulls between two daemons verified by Checksum for the dense, hybrid and MLA
presets (GPU only; skipped without CUDA)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
import torch

from kvxferd.errors import BlockRangeError
from kvxferd.ipc.host import device_uuid
from kvxferd.ipc.mapping import MappingCache
from kvxferd.ipc.publish import IpcPool, IpcRegion
from kvxferd.kernels import BackendName, CopyKernel, GroupCopy, RangeCopy, active_backend, twin
from kvxferd.kernels.ranges import address_table
from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import scheduler_pb2
from tests.service.conftest import Daemons, launch
from tests.service.test_service_staged import Client

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]

SIZES = [1 << 20, 3 << 19, 1 << 20]  # three regions, bytes


@pytest.fixture(scope="module")
def ops() -> Any:
    backend = active_backend()
    assert backend.name is BackendName.CUDA, backend.describe()  # a failed build fails here
    from kvxferd.kernels import cuda_ops

    return cuda_ops


def _random(n: int, seed: int, device: str = "cuda") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)


def _pieces(sizes: list[int], n: int, seed: int, align: int) -> RangeCopy:
    """``n`` random pieces per region, not overlapping on the destination side."""
    rng = np.random.default_rng(seed)
    cols: list[list[int]] = [[], [], [], []]
    for r, size in enumerate(sizes):
        slots = size // 8192
        for k, dst_slot in enumerate(rng.choice(slots, n, replace=False)):
            ln = int(rng.integers(1, 8192 // align)) * align
            src = int(rng.integers(0, (size - ln) // align)) * align
            cols[0].append(r)
            cols[1].append(int(dst_slot) * 8192 + (k % 2) * align)
            cols[2].append(src)
            cols[3].append(min(ln, 8192 - align))
    a = [np.array(c, dtype=np.int64) for c in cols]
    return RangeCopy(a[0], a[1], a[2], a[3])


@pytest.mark.parametrize("kernel", list(CopyKernel), ids=lambda k: k.name.lower())
@pytest.mark.parametrize("align", [16, 4, 1], ids=["v16", "v4", "v1"])
@pytest.mark.parametrize("max_ctas", [1, 7, 0])
def test_kernel_matches_the_twin_on_owned_memory(
    ops: Any, align: int, max_ctas: int, kernel: CopyKernel
) -> None:
    """Pieces of many lengths (the stride kernel skips the rest of each short piece's slot)."""
    src = [_random(n, 10 + i) for i, n in enumerate(SIZES)]
    rc = _pieces(SIZES, 40, seed=align * 100 + max_ctas, align=align)
    want = [torch.full((n,), 0xA5, dtype=torch.uint8, device="cuda") for n in SIZES]
    got = [t.clone() for t in want]
    twin.copy_ranges(want, src, rc)
    ops.copy_ranges(got, src, rc, max_ctas=max_ctas, kernel=kernel)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert ops.copy_vector_width(got, src, rc) == align


def test_bounds_and_bad_tables_are_refused_before_launch(ops: Any) -> None:
    src = [_random(1024, 1)]
    dst = [torch.zeros(1024, dtype=torch.uint8, device="cuda")]
    one = np.array([0], dtype=np.int64)
    past = RangeCopy(one, one, np.array([1000], dtype=np.int64), np.array([100], dtype=np.int64))
    with pytest.raises(BlockRangeError, match="src region 0, which has 1024 bytes"):
        ops.copy_ranges(dst, src, past)
    assert int(dst[0].sum()) == 0
    # The launcher's own checks (a caller that skipped check_ranges): nothing launched.
    table = address_table(dst, src, RangeCopy(one, one, one, np.array([8], dtype=np.int64)))
    table[0, 2] = 0
    from kvxferd.kernels.loader import cuda_ops

    assert "empty" in cuda_ops().copy_ranges(table, dst[0], 0, 0)
    table[0, 2], table[0, 1] = 8, 0
    assert "null" in cuda_ops().copy_ranges(table, dst[0], 0, 0)
    assert "CPU" in cuda_ops().copy_ranges(table.cuda(), dst[0], 0, 0)
    table[0, 1] = src[0].data_ptr()
    assert "unknown kernel variant 7" in cuda_ops().copy_ranges(table, dst[0], 0, 7)
    assert int(dst[0].sum()) == 0


def _miniature_pull(
    seed: int, src_seed: int, *, shared: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], Any]:
    """1 GiB-shaped in miniature: 8 regions x 64 random 4 KiB blocks and a 3-block run, as the
    planner lays it out (``shared``: every region the same arrays) or with arrays of their own.
    Returns the source regions, two equal destinations (the kernel's and the twin's) and the
    plan."""
    from kvxferd.blocks.ranges import RegionRanges, TransferPlan

    rng = np.random.default_rng(seed)
    block, blocks = 4096, 256
    src = [_random(block * blocks, src_seed + i) for i in range(8)]
    want = [torch.zeros(block * blocks, dtype=torch.uint8, device="cuda") for _ in range(8)]
    got = [t.clone() for t in want]
    local = np.concatenate([rng.choice(200, 64, replace=False), [201, 202, 203]])
    remote = np.concatenate([rng.choice(blocks, 64, replace=False), [9, 10, 11]])

    def arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return local * block, remote * block, np.full(local.size, block)

    one = arrays()
    plan = TransferPlan(
        tuple(RegionRanges(i, f"l{i}", *(one if shared else arrays())) for i in range(8))
    )
    return src, want, got, plan


def test_a_pull_planned_by_the_reader_is_copied_exactly(ops: Any) -> None:
    """The miniature pull cut by pieces() and copied by the stride kernel, equal to the
    twin."""
    from kvxferd.ipc.pieces import pieces

    src, want, got, plan = _miniature_pull(11, 30, shared=False)
    rc, _ = pieces(plan)
    ops.copy_ranges(got, src, rc)
    twin.copy_ranges(want, src, rc)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _groups(seed: int, align: int) -> list[GroupCopy]:
    """Two groups: runs shared by regions {0, 2} and runs of region 1 alone, every run inside
    the smallest region of its group, destinations not overlapping."""
    rng = np.random.default_rng(seed)
    out = []
    for regions, top in (([0, 2], min(SIZES[0], SIZES[2])), ([1], SIZES[1])):
        slots = rng.choice(top // 8192, 30, replace=False)
        ln = rng.integers(1, 8192 // align, size=slots.size) * align
        dst = slots * 8192
        src = rng.integers(0, (top - 8192) // align, size=slots.size) * align
        out.append(GroupCopy(np.array(regions, np.int64), dst, src, np.minimum(ln, 8192)))
    return out


@pytest.mark.parametrize("align", [16, 4, 1], ids=["v16", "v4", "v1"])
@pytest.mark.parametrize("max_ctas", [1, 7, 0])
def test_the_group_kernel_matches_the_twin(ops: Any, align: int, max_ctas: int) -> None:
    """copy_group: the runs once, repeated over each group's regions, as the twin copies the
    flattened pieces (cap 1: one CTA strides over both regions of the first group)."""
    src = [_random(n, 20 + i) for i, n in enumerate(SIZES)]
    gs = _groups(seed=align * 10 + max_ctas, align=align)
    want = [torch.full((n,), 0x5A, dtype=torch.uint8, device="cuda") for n in SIZES]
    got = [t.clone() for t in want]
    twin.copy_groups(want, src, gs)
    ops.copy_groups(got, src, gs, max_ctas=max_ctas)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize(
    "runs",
    [100, 300, 1400],
    ids=["table-with-the-launch", "table-in-a-32k-launch", "table-uploaded"],
)
def test_group_tables_inline_or_uploaded_run_on_the_stream_passed(ops: Any, runs: int) -> None:
    """A copy_group table of at most 480 values travels as the kernel's parameter, as does one
    of at most 4,000 where the CUDA version and the GPU take 32 KB of launch parameters (CUDA
    12.1, compute capability 7.0: every GPU these tests run on), a bigger one is uploaded; each
    copies what the twin copies, queued on the stream the caller passed: behind 0.1 s of work
    already on that stream, not on the current stream."""
    from kvxferd.kernels import prepare_copy, run_copy

    rng = np.random.default_rng(runs)
    slot, top = 512, min(SIZES[0], SIZES[2])
    slots = rng.choice(top // slot, runs, replace=False)
    ln = rng.integers(1, slot // 16, size=runs) * 16
    src_off = rng.integers(0, (top - slot) // 16, size=runs) * 16
    g = GroupCopy(np.array([0, 2], np.int64), slots * slot, src_off, ln)
    values = 3 * runs + 2 * 2
    assert (values <= 480, 480 < values <= 4000, values > 4000) == (
        runs == 100,
        runs == 300,
        runs == 1400,
    )
    src = [_random(n, 60 + i) for i, n in enumerate(SIZES)]
    want = [torch.full((n,), 0x33, dtype=torch.uint8, device="cuda") for n in SIZES]
    got = [t.clone() for t in want]
    before = [t.clone() for t in want]
    twin.copy_groups(want, src, [g])
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    # Once first: the first upload of a table this size allocates pinned memory, and
    # cudaHostAlloc waits for the whole device (it would wait for the sleep below).
    run_copy(prepare_copy([t.clone() for t in before], src, [g]), stream=stream.cuda_stream)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)
    run_copy(prepare_copy(got, src, [g]), stream=stream.cuda_stream)
    assert all(torch.equal(a, b) for a, b in zip(got, before, strict=True))  # not run yet
    stream.synchronize()  # type: ignore[no-untyped-call]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_group_bounds_and_bad_tables_are_refused_before_launch(ops: Any) -> None:
    src = [_random(1024, 1), _random(512, 2)]
    dst = [torch.zeros(1024, dtype=torch.uint8, device="cuda") for _ in range(2)]
    run = np.array([0], dtype=np.int64)
    past = GroupCopy(np.array([0, 1]), run, np.array([500]), np.array([100]))  # fits 0, not 1
    with pytest.raises(BlockRangeError, match="src region 1 has 512 bytes"):
        ops.copy_groups(dst, src, [past])
    assert int(dst[0].sum()) == 0 and int(dst[1].sum()) == 0
    from kvxferd.kernels.loader import cuda_ops
    from kvxferd.kernels.ranges import Regions, group_table

    d, s = Regions.of("dst", dst), Regions.of("src", src)
    table = group_table(d, s, GroupCopy(np.array([0]), run, run, np.array([8])))
    assert "3 per run and 2 per region" in cuda_ops().copy_group(table, 2, 1, dst[0], 0)
    table[2] = 0
    assert "empty" in cuda_ops().copy_group(table, 1, 1, dst[0], 0)
    table[2], table[0] = 8, -8
    assert "negative offset" in cuda_ops().copy_group(table, 1, 1, dst[0], 0)
    table[0], table[4] = 0, 0
    assert "null base" in cuda_ops().copy_group(table, 1, 1, dst[0], 0)
    assert "CPU" in cuda_ops().copy_group(table.cuda(), 1, 1, dst[0], 0)
    assert int(dst[0].sum()) == 0


def test_the_launch_binding_refuses_what_the_op_refuses(ops: Any) -> None:
    """copy_group_raw (cuda/bindings.cpp), what run_copy launches with: the op's refusals, and
    its own (a null table, a device that is not there); a copy whose table is not a contiguous
    1-D int64 CPU tensor is refused (when it is made) before any address is handed over.
    Nothing is copied."""
    from kvxferd.errors import InvalidRequest
    from kvxferd.kernels import prepare_copy, run_copy
    from kvxferd.kernels.loader import cuda_module
    from kvxferd.kernels.ranges import Regions, group_table

    raw = cuda_module().copy_group_raw
    src = [_random(1024, 1), _random(512, 2)]
    dst = [torch.zeros(1024, dtype=torch.uint8, device="cuda") for _ in range(2)]
    d, s = Regions.of("dst", dst), Regions.of("src", src)
    run = np.array([0], dtype=np.int64)
    table = group_table(d, s, GroupCopy(np.array([0]), run, run, np.array([8])))
    at, n = table.data_ptr(), table.numel()
    assert "3 per run and 2 per region" in raw(at, n, 2, 1, 0, 0, 0)
    assert "bad counts" in raw(at, n, 1, 0, 0, 0, 0)
    assert "null" in raw(0, n, 1, 1, 0, 0, 0)
    assert "no CUDA device 99" in raw(at, n, 1, 1, 99, 0, 0)
    assert "max_ctas" in raw(at, n, 1, 1, 0, -1, 0)
    table[0] = -8
    assert "negative offset" in raw(at, n, 1, 1, 0, 0, 0)
    copy = prepare_copy(dst, src, [GroupCopy(np.array([0, 1]), run, run, np.array([8]))])
    bad = copy.tables[0].to(torch.int32)
    with pytest.raises(InvalidRequest, match="contiguous 1-D int64 CPU tensor"):
        run_copy(type(copy)(copy.dst, copy.src, None, copy.groups, (bad,), True))
    torch.cuda.synchronize()
    assert int(dst[0].sum()) == 0 and int(dst[1].sum()) == 0
    good = copy.tables[0]
    assert raw(good.data_ptr(), good.numel(), 1, 2, 0, 0, 0) == ""  # the binding copies
    torch.cuda.synchronize()
    assert torch.equal(dst[1][:8], src[1][:8]) and torch.equal(dst[0][:8], src[0][:8])


def test_a_pull_planned_by_the_reader_is_copied_exactly_grouped(ops: Any) -> None:
    """The same miniature pull, its regions sharing the planner's arrays, through group_pieces
    (one group of 8 regions)."""
    from kvxferd.ipc.pieces import group_pieces

    src, want, got, plan = _miniature_pull(12, 40, shared=True)
    gs, _ = group_pieces(plan)
    assert isinstance(gs, list) and len(gs) == 1 and gs[0].regions.size == 8
    ops.copy_groups(got, src, gs)
    twin.copy_groups(want, src, gs)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


# -- memory imported over CUDA IPC from another process -------------------------------------


def _owner(conn: Connection, sizes: list[int], seed: int) -> None:
    from kvxferd.attach.cuda_ipc import export_tensor

    torch.cuda.set_device(0)
    regions = [_random(n, seed + i) for i, n in enumerate(sizes)]
    torch.cuda.synchronize()
    exports = [export_tensor(t, t.numel()) for t in regions]
    conn.send(([(e.handle, e.offset, e.nbytes) for e in exports], [t.cpu() for t in regions]))
    conn.recv()  # stay alive (and keep the memory) until told


class Owner:
    """A process exporting random regions over CUDA IPC (a daemon-owned pool stand-in)."""

    def __init__(self, seed: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_owner, args=(child, SIZES, seed), daemon=True)
        self.proc.start()
        assert self.conn.poll(120), "owner did not start"
        handles, self.data = self.conn.recv()
        uuid = device_uuid(0)
        assert uuid is not None
        self.ipc = IpcPool(tuple(IpcRegion(h, o, n, uuid) for h, o, n in handles))

    def stop(self) -> None:
        self.conn.send("stop")
        self.proc.join(30)


@pytest.fixture
def owner() -> Iterator[Owner]:
    o = Owner(seed=50)
    yield o
    o.stop()


def test_kernel_matches_the_twin_on_imported_memory(ops: Any, owner: Owner) -> None:
    cache = MappingCache(device=0)
    maps = cache.get(("owner", "i1", 1), owner.ipc)
    rc = _pieces(SIZES, 60, seed=3, align=16)
    got = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in SIZES]
    gs = _groups(seed=5, align=16)
    grouped = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in SIZES]
    with maps.use() as src:
        ops.copy_ranges(got, src, rc, max_ctas=16)
        ops.copy_groups(grouped, src, gs, max_ctas=16)
        torch.cuda.synchronize()
    want = [torch.zeros(n, dtype=torch.uint8) for n in SIZES]
    twin.copy_ranges(want, owner.data, rc)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want, strict=True))
    want_g = [torch.zeros(n, dtype=torch.uint8) for n in SIZES]
    twin.copy_groups(want_g, owner.data, gs)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(grouped, want_g, strict=True))
    cache.close()
    assert maps.closed


def test_a_restarted_owner_is_mapped_afresh_and_its_old_mappings_are_dropped(ops: Any) -> None:
    cache = MappingCache(device=0)
    first = Owner(seed=1)
    old = cache.get(("owner", "i1", 1), first.ipc)
    raw = [m._m for m in old.mappings]  # type: ignore[attr-defined]
    first.stop()  # the owner "restarts": a new process, new memory, new handles
    second = Owner(seed=2)
    try:
        new = cache.get(("owner", "i2", 1), second.ipc)
        assert old.closed and all(m.closed for m in raw)  # never pinned by stale mappings
        got = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in SIZES]
        rc = _pieces(SIZES, 10, seed=4, align=16)
        with new.use() as src:
            ops.copy_ranges(got, src, rc)
            torch.cuda.synchronize()
        want = [torch.zeros(n, dtype=torch.uint8) for n in SIZES]
        twin.copy_ranges(want, second.data, rc)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want, strict=True))
    finally:
        cache.close()
        second.stop()


# -- through two daemons on one GPU ----------------------------------------------------------

PRESETS = {
    "dense": ("dense:num_blocks=256", lambda r: [r.sample(range(256), 100)]),
    "hybrid": (
        "hybrid:num_blocks=16,ppl=4",
        lambda r: [r.sample(range(16), 6), r.sample(range(16), 6)],
    ),
    "mla": ("mla:num_blocks=64,num_layers=8", lambda r: [r.sample(range(64), 20)]),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_kernel_pull_between_daemons_is_byte_exact(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    text, ids = PRESETS[name]
    ds: Daemons = launch(
        tmp_path_factory.mktemp(f"kernel-{name}"),
        DaemonOptions("prefill", text, device="cuda:0", fill_seed=6),
        DaemonOptions("decode", text, device="cuda:0"),
    )
    try:

        async def go() -> None:
            c = Client(ds["prefill"], ds["decode"])
            rng = random.Random(7)
            for k in range(3):  # later pulls reuse the reader's completion events
                remote, local = ids(rng), ids(rng)
                st = await c.pull(await c.hold(f"kernel-{name}-{k}", remote), local)
                assert st.state == scheduler_pb2.TRANSFER_STATE_DONE, st.error.message
                assert st.strategy == scheduler_pb2.TRANSFER_STRATEGY_KERNEL, st.strategy_reason
                assert await c.same(remote, local)
            peers = await c.decode.ListPeers(scheduler_pb2.ListPeersRequest())
            assert peers.peers[0].same_host

        asyncio.run(go())
    finally:
        ds.stop()
