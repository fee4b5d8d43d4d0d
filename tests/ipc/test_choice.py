"""KERNEL eligibility, its place in the cost model's choice, the transport classification and
the refusal of a slow GPU link, the UCX environment decision, and the owner's export (pure)."""

from __future__ import annotations

import math

import pytest

from kvxferd.errors import SlowTransport
from kvxferd.ipc.eligibility import kernel_ineligible
from kvxferd.ipc.host import GET_ZCOPY_VAR, decide_get_zcopy, format_uuid, host_id
from kvxferd.ipc.publish import IpcPool, IpcRegion, Publisher
from kvxferd.ipc.transport import SLOW_GBPS, classify, refusal
from kvxferd.layout.presets import preset
from kvxferd.layout.spec import MemoryType
from kvxferd.pool import KVPool
from kvxferd.staging.strategy import CostModel, Mode, Strategy, choose
from kvxferd.v1 import peer_pb2
from tests.ipc.fakes import UUID, handle

VRAM, DRAM = MemoryType.VRAM, MemoryType.DRAM
IPC = IpcPool((IpcRegion(handle("a"), 0, 64, UUID), IpcRegion(handle("a"), 64, 64, UUID)))
GPU = CostModel.defaults(VRAM)
GIB = 1 << 30


def _why(**over: object) -> str | None:
    kw: dict[str, object] = {
        "enabled": True,
        "local_memory": VRAM,
        "remote_memory": VRAM,
        "my_host": "h1",
        "remote_host": "h1",
        "remote_ipc": IPC,
        "remote_regions": 2,
        "open_failure": None,
        "peer": "p:1",
    }
    kw.update(over)
    return kernel_ineligible(**kw)  # type: ignore[arg-type]


def test_kernel_eligible_on_one_host_with_vram_and_handles() -> None:
    assert _why() is None


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"enabled": False}, "transfer.cuda_ipc = false"),
        ({"local_memory": DRAM}, "this daemon's pool is in host memory"),
        ({"remote_memory": DRAM}, "peer p:1's pool is in host memory"),
        ({"remote_host": ""}, "older kvxferd"),
        ({"remote_host": "h2"}, "another host"),
        ({"remote_ipc": None}, "publishes no CUDA IPC handles"),
        ({"remote_ipc": IpcPool((), "expandable_segments")}, "expandable_segments"),
        ({"remote_regions": 3}, "2 CUDA IPC regions for 3 registered regions"),
        ({"open_failure": "CUDA_ERROR_MAP_FAILED"}, "CUDA_ERROR_MAP_FAILED"),
    ],
)
def test_kernel_ineligible_says_why(over: dict[str, object], needle: str) -> None:
    why = _why(**over)
    assert why is not None and needle in why


@pytest.mark.parametrize("mode", [Mode.AUTO, Mode.KERNEL])
@pytest.mark.parametrize("descriptors", [32, 16384])
def test_kernel_is_picked_whenever_eligible(mode: Mode, descriptors: int) -> None:
    c = choose(
        mode,
        GPU,
        descriptors=descriptors,
        nbytes=GIB,
        chunks=16,
        ineligible=None,
        kernel_ineligible=None,
    )
    assert c.strategy is Strategy.KERNEL
    assert "CUDA IPC" in c.reason and c.kernel_s < c.direct_s


def test_forced_direct_and_staged_still_win_over_kernel() -> None:
    kw = {"descriptors": 16384, "nbytes": GIB, "chunks": 16, "ineligible": None}
    assert choose(Mode.DIRECT, GPU, kernel_ineligible=None, **kw).strategy is Strategy.DIRECT  # type: ignore[arg-type]
    assert choose(Mode.STAGED, GPU, kernel_ineligible=None, **kw).strategy is Strategy.STAGED  # type: ignore[arg-type]


def test_forced_kernel_that_cannot_run_falls_back_to_auto() -> None:
    c = choose(
        Mode.KERNEL,
        GPU,
        descriptors=32,
        nbytes=GIB,
        chunks=16,
        ineligible=None,
        kernel_ineligible="peer runs on another host",
    )
    assert c.strategy is Strategy.DIRECT
    assert c.reason.startswith("forced kernel, but KERNEL not possible: peer runs on another host")
    assert math.isnan(c.kernel_s)


def test_auto_without_kernel_keeps_staged_only_where_clearly_cheaper() -> None:
    # No kernel information (old callers): the DIRECT/STAGED choice is unchanged in kind.
    assert (
        choose(Mode.AUTO, GPU, descriptors=32, nbytes=GIB, chunks=16, ineligible=None).strategy
        is Strategy.DIRECT
    )


def test_classify_names_and_the_slow_gpu_link() -> None:
    tcp = classify(local_vram=True, remote_vram=True, same_host=True, gbps=0.41)
    assert tcp.name == "tcp" and tcp.slow
    ipc = classify(local_vram=True, remote_vram=True, same_host=True, gbps=SLOW_GBPS * 5)
    assert ipc.name == "cuda_ipc" and not ipc.slow
    assert classify(local_vram=True, remote_vram=True, same_host=False, gbps=20).name == "rdma"
    # Host memory is never "slow" in the refusal's sense, whatever its transport.
    dram = classify(local_vram=False, remote_vram=False, same_host=True, gbps=0.1)
    assert dram.name == "tcp" and not dram.slow
    assert classify(local_vram=False, remote_vram=False, same_host=True, gbps=3.0).name == "cma"
    unknown = classify(
        local_vram=True, remote_vram=True, same_host=True, gbps=math.nan, why_not="no ring"
    )
    assert unknown.name == "unknown" and not unknown.slow and "no ring" in unknown.detail


def test_refusal_names_the_transport_and_every_fix() -> None:
    err = refusal(
        classify(local_vram=True, remote_vram=True, same_host=True, gbps=0.4), "p:1", "DIRECT"
    )
    assert isinstance(err, SlowTransport)
    text = str(err)
    for needle in (
        "DIRECT pull from p:1",
        "tcp at 0.40 GB/s",
        "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y",
        "transfer.cuda_ipc = true",
        "transfer.allow_slow_transport = true",
    ):
        assert needle in text


def test_get_zcopy_is_set_only_for_a_gpu_without_nvlink_and_never_over_the_operator() -> None:
    env: dict[str, str] = {}
    note = decide_get_zcopy("cuda:0", env, lambda: False)
    assert note.set_get_zcopy and env == {GET_ZCOPY_VAR: "y"} and "no NVLink" in note.reason
    env = {GET_ZCOPY_VAR: "n"}
    note = decide_get_zcopy("cuda:0", env, lambda: False)
    assert not note.set_get_zcopy and env[GET_ZCOPY_VAR] == "n" and "operator" in note.reason
    env = {}
    assert not decide_get_zcopy("cuda:1", env, lambda: True).set_get_zcopy and not env
    assert not decide_get_zcopy("cuda", env, lambda: None).set_get_zcopy and not env
    assert not decide_get_zcopy("cpu", env, lambda: False).set_get_zcopy and not env


def test_host_identity_and_uuid_format() -> None:
    assert host_id() == host_id() and len(host_id()) == 16
    assert format_uuid(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def test_export_round_trips_and_malformed_exports_become_unavailable() -> None:
    assert IpcPool.from_proto(IPC.to_proto()) == IPC
    bad = peer_pb2.CudaIpcExport(
        regions=[peer_pb2.CudaIpcRegion(handle=b"short", nbytes=8, device_uuid=UUID)]
    )
    got = IpcPool.from_proto(bad)
    assert not got.regions and "malformed" in got.unavailable
    assert IpcPool.from_proto(peer_pb2.CudaIpcExport(unavailable="why")).unavailable == "why"


def test_publisher_exports_once_per_generation_and_reports_failures() -> None:
    spec = preset("dense:num_blocks=4,num_layers=2,num_kv_heads=1,head_size=8,block_size=4")
    calls: list[int] = []

    def exporter(t: object, nbytes: int) -> tuple[bytes, int]:
        calls.append(nbytes)
        return handle("x"), 0

    dram = KVPool.allocate(spec)
    pub = Publisher(exporter=exporter, uuid_of=lambda d: UUID)
    assert pub.export(dram, 1) is None  # host memory: nothing to publish
    vram = KVPool(spec.with_memory(VRAM), dram.tensors)
    first = pub.export(vram, 1)
    assert first is not None and len(first.regions) == 2 and len(calls) == 2
    assert pub.export(vram, 1) is first and len(calls) == 2
    pub.export(vram, 2)
    assert len(calls) == 4
    assert Publisher(enabled=False).export(vram, 1) == IpcPool((), "its transfer.cuda_ipc = false")
    none = Publisher(exporter=exporter, uuid_of=lambda d: None).export(vram, 1)
    assert none is not None and "UUID" in none.unavailable
