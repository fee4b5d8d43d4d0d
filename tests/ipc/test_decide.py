"""The per-pull decision with a handshaken peer (CPU): KERNEL when eligible (its mappings opened
once), the reasons when not, and the refusal of DIRECT/STAGED over a GPU link probed at TCP
speed unless transfer.allow_slow_transport."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvxferd.blocks import plan_pull
from kvxferd.blocks.ranges import PullPlan
from kvxferd.daemon.moves import Mover
from kvxferd.daemon.pulls import PullBook, PullRequest
from kvxferd.daemon.receiver import PushReceiver
from kvxferd.errors import SlowTransport
from kvxferd.ipc.mapping import MappingCache
from kvxferd.ipc.reader import KernelReader, ReadyPull
from kvxferd.ipc.transport import TransportReport, classify
from kvxferd.layout.presets import preset
from kvxferd.layout.spec import MemoryType
from kvxferd.pool import KVPool
from kvxferd.staging.facts import PairFacts
from kvxferd.staging.setup import IpcSide, Staging, decide
from kvxferd.staging.strategy import CostModel, Mode, Strategy
from kvxferd.transfer.state import TransferStatus
from tests.ipc.fakes import FakeHost, FakeInfo, FakeLink, FakeRemote, export_pool, ordinal_of

TEXT = "dense:num_blocks=16,num_layers=2,num_kv_heads=1,head_size=16,block_size=4"
SPEC = preset(TEXT).with_memory(MemoryType.VRAM)
SLOW = classify(local_vram=True, remote_vram=True, same_host=True, gbps=0.4)
FAST = classify(local_vram=True, remote_vram=True, same_host=True, gbps=300.0)


def _setup(
    *,
    host: str = "h1",
    transport: TransportReport | None = FAST,
    allow: bool = False,
    fail: str = "",
    mode: Mode = Mode.AUTO,
) -> tuple[Staging, FakeLink, FakeHost]:
    owner = KVPool.allocate(preset(TEXT))
    reader = KVPool.allocate(preset(TEXT))
    fh = FakeHost(fail=fail)
    ipc = export_pool(fh, owner, "own")
    kernel = KernelReader(
        reader, MappingCache(device=0, opener=fh.open, ordinal_of=ordinal_of), max_ctas=8
    )
    staging = Staging(
        mode,
        CostModel.defaults(MemoryType.VRAM),
        ipc=IpcSide(host_id="h1", allow_slow_transport=allow),
        kernel=kernel,
    )
    rows = np.array([[1 << 20, SPEC.regions[0].nbytes, 0]] * len(SPEC.regions), dtype=np.int64)
    link = FakeLink(FakeRemote(FakeInfo(SPEC), rows, host, ipc), transport)
    return staging, link, fh


def _decide(  # type: ignore[no-untyped-def]
    staging: Staging, link: FakeLink, n: int = 4, plan: PullPlan | None = None
):
    if plan is None:
        plan = plan_pull(
            SPEC, SPEC, [list(range(n))], [list(range(8, 8 + n))], prefix_caching=False
        )
    return decide(
        staging,
        local=SPEC,
        remote=SPEC,
        local_tp_size=1,
        remote_tp_size=1,
        remote_ring=None,
        plan=plan,
        part=plan.per_rank[0],
        peer="p:1",
        link=link,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("transport", [FAST, SLOW, None])
def test_same_host_gpu_peer_is_kernel_whatever_its_ucx_transport(
    transport: TransportReport | None,
) -> None:
    staging, link, fh = _setup(transport=transport)
    d = _decide(staging, link)
    assert d.choice.strategy is Strategy.KERNEL
    assert len(fh.opened) == len(SPEC.regions)  # opened at decision time ...
    _decide(staging, link)
    assert len(fh.opened) == len(SPEC.regions)  # ... once per peer generation


def test_a_same_host_copy_does_not_work_out_staged(monkeypatch: pytest.MonkeyPatch) -> None:
    """STAGED's eligibility (the peer pair's facts) is not worked out for a pull KERNEL takes
    anyway; for a peer on another host it is."""
    asked: list[str] = []

    def facts(self: PairFacts, *args: object, **kwargs: object) -> tuple[str, None]:
        asked.append("facts")
        return "no staging ring", None

    monkeypatch.setattr(PairFacts, "get", facts)
    staging, link, _ = _setup()
    assert _decide(staging, link).choice.strategy is Strategy.KERNEL
    assert asked == []
    staging, link, _ = _setup(host="h2")
    assert _decide(staging, link).choice.strategy is Strategy.DIRECT
    assert asked == ["facts"]


@pytest.mark.parametrize("mode", [Mode.DIRECT, Mode.STAGED])
def test_a_pull_forced_to_nixl_does_not_work_out_kernel(mode: Mode) -> None:
    """transfer.strategy = direct or staged: a same-host peer that KERNEL could copy from is
    read over NIXL, and its CUDA IPC handles are not opened for a copy that will not run."""
    staging, link, fh = _setup(mode=mode)
    d = _decide(staging, link)
    assert d.choice.strategy is Strategy.DIRECT  # STAGED falls back: no staging ring here
    assert "STAGED not possible" in d.choice.reason and "KERNEL" not in d.choice.reason
    assert fh.opened == []


def test_another_host_over_a_slow_gpu_link_is_refused_with_the_fix() -> None:
    staging, link, _ = _setup(host="h2", transport=SLOW)
    with pytest.raises(SlowTransport) as ei:
        _decide(staging, link)
    text = str(ei.value)
    assert "DIRECT pull from p:1" in text and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in text
    assert "transfer.allow_slow_transport = true" in text


def test_allow_slow_transport_lets_it_run_direct() -> None:
    staging, link, _ = _setup(host="h2", transport=SLOW, allow=True)
    d = _decide(staging, link)
    assert d.choice.strategy is Strategy.DIRECT
    assert "another host" not in d.choice.reason  # auto: the reason is the DIRECT/STAGED one


def test_forced_kernel_on_another_host_falls_back_and_says_why() -> None:
    staging, link, _ = _setup(host="h2", transport=FAST, mode=Mode.KERNEL)
    d = _decide(staging, link)
    assert d.choice.strategy is Strategy.DIRECT
    assert "runs on another host" in d.choice.reason


def test_a_failed_open_falls_back_and_is_not_retried() -> None:
    staging, link, fh = _setup(fail="cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_DEVICE")
    staging = Staging(Mode.KERNEL, staging.model, ipc=staging.ipc, kernel=staging.kernel)
    d = _decide(staging, link)
    assert d.choice.strategy is Strategy.DIRECT
    assert "CUDA_ERROR_INVALID_DEVICE" in d.choice.reason
    fh.fail = ""
    assert _decide(staging, link).choice.strategy is Strategy.DIRECT  # same generation
    assert fh.opened == []


def test_a_full_prefix_hit_moves_nothing_and_is_never_refused() -> None:
    staging, link, _ = _setup(host="h2", transport=SLOW)
    d = _decide(staging, link, n=0)
    assert d.choice.strategy is Strategy.DIRECT


def test_a_kernel_pull_is_prepared_while_its_lease_is_confirmed() -> None:
    """The reader's Mover does a KERNEL pull's host work before the confirmation (pieces
    checked, tables built) and the pull launches with it; in push mode nothing is prepared
    (the owner WRITEs)."""
    staging, link, fh = _setup()
    owner_pool = KVPool.allocate(preset(TEXT))
    owner_pool.fill_pattern(0, list(range(16)), seed=21)
    link.remote.ipc = export_pool(fh, owner_pool, "filled")
    plan = plan_pull(SPEC, SPEC, [[0, 1, 2]], [[8, 9, 10]], prefix_caching=False)
    part = plan.per_rank[0]
    decision = _decide(staging, link, plan=plan)
    assert decision.choice.strategy is Strategy.KERNEL
    req = PullRequest("t1", "r1", "p:1", ([8, 9, 10],), ([0, 1, 2],), 30.0)  # type: ignore[arg-type]
    parts = SimpleNamespace(staging=staging)
    ready = Mover(parts, PullBook(), None).prepare(req, link, part, decision)  # type: ignore[arg-type]
    assert isinstance(ready, ReadyPull) and ready.plan is part
    result = asyncio.run(
        staging.kernel_pull(
            "t1",
            link.remote,  # type: ignore[arg-type]
            peer_address="p:1",
            plan=part,
            local_blocks=plan.local_kernel_blocks,
            deadline=time.monotonic() + 30,
            ready=ready,
        )
    )
    assert result.status is TransferStatus.DONE, result.reason
    assert staging.kernel is not None and staging.kernel.last.ready
    assert staging.kernel.pool.checksums(0, [0, 1, 2]) == owner_pool.checksums(0, [8, 9, 10])
    push = Mover(parts, PullBook(), PushReceiver())  # type: ignore[arg-type]
    assert push.prepare(req, link, part, decision) is None  # type: ignore[arg-type]
