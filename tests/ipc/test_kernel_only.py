"""Pools served by KERNEL only (engine-attached IMPORTED VRAM, issue 13), on CPU: the owner
publishes the engine's own handles and says so in the handshake; a pull that cannot be KERNEL,
from such an owner or into such a pool, is refused with the reason and the fix; a pull that
moves nothing or can be KERNEL is not; the transport probe leaves such a peer alone."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
import time
import weakref

import pytest

from kvxferd.blocks import plan_pull
from kvxferd.daemon.handshake import decode_envelope
from kvxferd.errors import SlowTransport, SpecError
from kvxferd.ipc.eligibility import kernel_only_refusal
from kvxferd.ipc.publish import KERNEL_ONLY, IpcPool, IpcRegion, Publisher
from kvxferd.ipc.transport import probe_peer
from kvxferd.layout.presets import preset
from kvxferd.layout.spec import MemoryType
from kvxferd.pool import KVPool
from kvxferd.staging.setup import IpcSide, Staging
from kvxferd.staging.strategy import Mode, Strategy
from kvxferd.transfer.state import TransferResult, TransferStatus
from kvxferd.v1 import peer_pb2
from tests.ipc.fakes import UUID, FakeLink, export_pool, handle
from tests.ipc.test_decide import SPEC, TEXT, _decide, _setup
from tests.service.raw_peer import describe

VRAM = MemoryType.VRAM


def _vram_pool() -> KVPool:
    dram = KVPool.allocate(preset(TEXT))
    return KVPool(dram.spec.with_memory(VRAM), dram.tensors)


def _refuses(exc: pytest.ExceptionInfo[SlowTransport], *needles: str) -> str:
    text = str(exc.value)
    for n in needles:
        assert n in text, text
    return text


# -- the owner's export --------------------------------------------------------------------------


def test_an_imported_pool_is_published_with_the_engines_handles_and_as_kernel_only() -> None:
    calls: list[int] = []

    def exporter(t: object, n: int) -> tuple[bytes, int]:
        calls.append(n)  # an opened handle cannot be exported again: never called for it
        return handle("own"), 0

    pub = Publisher(exporter=exporter, uuid_of=lambda d: UUID)
    pool = _vram_pool()
    engine = [(handle("engine-alloc"), 4096 * i) for i in range(len(pool.memory))]
    assert pub.kernel_only == ""
    pub.forward(pool, engine)
    got = pub.export(pool, 7)
    assert got is not None and got.kernel_only == KERNEL_ONLY and not got.unavailable
    assert [(r.handle, r.offset) for r in got.regions] == engine
    assert [r.nbytes for r in got.regions] == [m.nbytes for m in pool.memory]
    assert {r.device_uuid for r in got.regions} == {UUID}
    assert pub.export(pool, 8) is got and calls == []
    assert "did not register with NIXL" in pub.kernel_only and "0.5-0.6 GB/s" in pub.kernel_only
    # Another pool (the next OWNED attach) is exported as before; the forwarded one no more.
    other = _vram_pool()
    assert pub.export(other, 9) is not None and calls
    pub.forget()
    assert pub.kernel_only == ""
    again = pub.export(pool, 10)
    assert again is not None and again.kernel_only == ""


def test_the_publisher_never_keeps_an_imported_pool_alive() -> None:
    pub = Publisher(uuid_of=lambda d: UUID)
    pool = _vram_pool()
    pub.forward(pool, [(handle("e"), 0)] * len(pool.memory))
    assert pub.export(pool, 1) is not None and pub.kernel_only
    alive = weakref.ref(pool)
    del pool
    gc.collect()
    assert alive() is None  # nothing in the publisher holds it (or the engine memory it maps)
    assert pub.kernel_only == ""


def test_forwarding_is_refused_when_nobody_could_read_the_pool() -> None:
    pool = _vram_pool()
    with pytest.raises(SpecError, match=r"transfer.cuda_ipc = false.*MEMORY_MODE_OWNED"):
        Publisher(enabled=False).forward(pool, [(handle("e"), 0)] * len(pool.memory))
    with pytest.raises(SpecError, match="UUID of GPU 0 is unknown"):
        Publisher(uuid_of=lambda d: None).forward(pool, [(handle("e"), 0)] * len(pool.memory))
    with pytest.raises(SpecError, match="1 handles for 2 regions"):
        Publisher(uuid_of=lambda d: UUID).forward(pool, [(handle("e"), 0)])


def test_the_handshake_carries_kernel_only_both_ways() -> None:
    me = describe(TEXT, "owner", "i1")
    ipc = IpcPool((IpcRegion(handle("e"), 0, 64, UUID),), kernel_only=KERNEL_ONLY)
    kernel_only = dataclasses.replace(me, ipc=ipc)
    payload = peer_pb2.HandshakePayload.FromString(kernel_only.envelope()[2])
    assert payload.kernel_only_reason == KERNEL_ONLY
    version, digest, raw = kernel_only.envelope()
    remote = decode_envelope(version, digest, raw, me, "p:1")
    assert remote.kernel_only == KERNEL_ONLY
    assert remote.ipc is not None and remote.ipc.regions[0].handle == handle("e")
    plain = decode_envelope(*me.envelope(), me, "p:1")
    assert plain.kernel_only == ""  # every other pool, and old peers


# -- the refusal (pure) --------------------------------------------------------------------------


def _refusal(**over: object) -> SlowTransport | None:
    kw: dict[str, object] = {
        "strategy": "DIRECT",
        "why_not_kernel": "peer p:1 runs on another host or IPC namespace",
        "nbytes": 4096,
        "remote_kernel_only": KERNEL_ONLY,
        "local_kernel_only": "",
        "peer": "p:1",
    }
    kw.update(over)
    return kernel_only_refusal(**kw)  # type: ignore[arg-type]


def test_kernel_only_refusal_names_the_reason_and_both_fixes() -> None:
    err = _refusal()
    assert isinstance(err, SlowTransport)
    text = str(err)
    assert "peer p:1 serves its pool with KERNEL pulls only" in text
    assert "0.5-0.6 GB/s" in text and "another host" in text
    assert "a DIRECT pull would read the unregistered memory" in text
    assert "mode='owned'" in text and "on the owner's host" in text
    assert "docs/attachment.md" in text and err.field == "peer_address"
    local = _refusal(strategy="STAGED", remote_kernel_only="", local_kernel_only=KERNEL_ONLY)
    assert local is not None
    assert "this daemon's pool is written with KERNEL pulls only" in str(local)
    assert "a STAGED pull would write" in str(local) and "mode='owned'" in str(local)


@pytest.mark.parametrize(
    "over",
    [
        {"strategy": "KERNEL"},
        {"nbytes": 0},
        {"remote_kernel_only": ""},
    ],
    ids=["kernel", "nothing-to-move", "nixl-pools"],
)
def test_kernel_only_refusal_leaves_what_is_fine_alone(over: dict[str, object]) -> None:
    assert _refusal(**over) is None


# -- decide(): the refusal at StartPull -----------------------------------------------------------


def _kernel_only_owner(**kw: object):  # type: ignore[no-untyped-def]
    staging, link, fh = _setup(**kw)  # type: ignore[arg-type]
    link.remote.kernel_only = KERNEL_ONLY
    return staging, link, fh


def test_a_same_host_reader_pulls_a_kernel_only_owner_with_kernel() -> None:
    staging, link, fh = _kernel_only_owner()
    assert _decide(staging, link).choice.strategy is Strategy.KERNEL
    assert len(fh.opened) == len(SPEC.regions)


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        ({"host": "h2"}, "runs on another host"),
        ({"mode": Mode.DIRECT}, "this daemon's transfer.strategy = direct"),
        ({"mode": Mode.STAGED}, "this daemon's transfer.strategy = staged"),
    ],
    ids=["another-host", "forced-direct", "forced-staged"],
)
def test_a_reader_that_cannot_use_kernel_is_refused_at_start_pull(
    setup: dict[str, object], needle: str
) -> None:
    staging, link, _ = _kernel_only_owner(**setup)
    with pytest.raises(SlowTransport) as ei:
        _decide(staging, link)
    _refuses(ei, "KERNEL pulls only", needle, "mode='owned'")


def _pull(staging: Staging, link: FakeLink, remote: object) -> TransferResult:
    """Decide against ``link`` (what the reader handshook), then run the KERNEL pull against
    ``remote`` (the owner as the lease confirmation found it)."""
    plan = plan_pull(SPEC, SPEC, [[0, 1]], [[8, 9]], prefix_caching=False)
    assert _decide(staging, link).choice.strategy is Strategy.KERNEL
    return asyncio.run(
        staging.kernel_pull(
            "t1",
            remote,  # type: ignore[arg-type]
            peer_address="p:1",
            plan=plan.per_rank[0],
            local_blocks=plan.local_kernel_blocks,
            deadline=time.monotonic() + 30,
        )
    )


def test_handles_that_do_not_open_fail_the_pull_with_the_reason() -> None:
    """The handles the reader holds may be an earlier generation's, so StartPull goes ahead;
    if the current ones do not open either, the pull fails saying why (nothing copied)."""
    staging, link, fh = _kernel_only_owner(fail="cuIpcOpenMemHandle failed: CUDA_ERROR_MAP_FAILED")
    before = staging.kernel.pool.checksums(0, [0, 1])  # type: ignore[union-attr]
    result = _pull(staging, link, link.remote)
    assert result.status is TransferStatus.FAILED
    assert "CUDA_ERROR_MAP_FAILED" in result.reason and fh.opened == []
    assert staging.kernel.pool.checksums(0, [0, 1]) == before  # type: ignore[union-attr]


def test_a_reattached_engines_handles_replace_the_old_generations() -> None:
    """The reader handshook generation 1; the owner's engine re-attached (generation 2, new
    memory, new handles) and the old handles no longer open: the pull maps generation 2."""
    staging, link, fh = _kernel_only_owner()
    old = link.remote
    assert _decide(staging, link).choice.strategy is Strategy.KERNEL  # maps generation 1
    staging.kernel.forget(old.agent_name, "unused for 10s")  # type: ignore[union-attr]
    fh.buffers.clear()  # the old engine's memory is gone
    new_pool = KVPool.allocate(preset(TEXT))
    new_pool.fill_pattern(0, list(range(16)), seed=44)
    new = dataclasses.replace(old, generation=2, ipc=export_pool(fh, new_pool, "engine-2"))
    result = _pull(staging, link, new)
    assert result.status is TransferStatus.DONE, result.reason
    local = staging.kernel.pool  # type: ignore[union-attr]
    assert local.checksums(0, [0, 1]) == new_pool.checksums(0, [8, 9])


def test_a_reader_with_cuda_ipc_off_is_refused() -> None:
    staging, link, _ = _kernel_only_owner()
    off = Staging(Mode.AUTO, staging.model, ipc=IpcSide(enabled=False, host_id="h1"))
    with pytest.raises(SlowTransport) as ei:
        _decide(off, link)
    _refuses(ei, "KERNEL pulls only", "this daemon's transfer.cuda_ipc = false")


def test_a_full_prefix_hit_from_a_kernel_only_owner_is_not_refused() -> None:
    staging, link, _ = _kernel_only_owner(host="h2")
    assert _decide(staging, link, n=0).choice.strategy is Strategy.DIRECT


def _local_kernel_only(staging: Staging) -> Staging:
    pub = Publisher(uuid_of=lambda d: UUID)
    local = staging.kernel.pool if staging.kernel is not None else _vram_pool()
    pub.forward(local, [(handle("mine"), 0)] * len(local.memory))
    ipc = IpcSide(host_id="h1", publisher=pub)
    return Staging(staging.mode, staging.model, ipc=ipc, kernel=staging.kernel)


def test_a_kernel_only_reader_copies_with_kernel_and_refuses_nixl_into_its_pool() -> None:
    staging, link, _ = _setup()
    mine = _local_kernel_only(staging)
    assert _decide(mine, link).choice.strategy is Strategy.KERNEL
    staging, link, _ = _setup(host="h2")
    with pytest.raises(SlowTransport) as ei:
        _decide(_local_kernel_only(staging), link)
    _refuses(ei, "this daemon's pool is written with KERNEL pulls only", "another host")


# -- the transport probe ------------------------------------------------------------------------


class _NoAgent:
    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the probe touched the NIXL agent ({name})")


def test_the_probe_reads_nothing_from_a_kernel_only_peer() -> None:
    report = asyncio.run(
        probe_peer(
            _NoAgent(),  # type: ignore[arg-type]
            None,
            peer_agent="owner",
            remote_region=(1 << 20, 4096, 0),
            local_vram=True,
            remote_vram=True,
            same_host=True,
            kernel_only=KERNEL_ONLY,
        )
    )
    assert report.name == "unknown" and math.isnan(report.read_gbps) and not report.slow
    assert "serves KERNEL pulls only" in report.detail
