"""IMPORTED VRAM decisions that need no GPU (issue 13): where the daemon accepts it (a GPU
daemon that can serve it with KERNEL pulls) and where it refuses it with the reason and the fix;
what the engine client checks before it sends anything. The GPU path itself:
tests/attach/test_imported_vram_gpu.py."""

from __future__ import annotations

import pytest
import torch

from kvxferd.daemon.attach_memory import (
    AttachRequest,
    Built,
    MemoryMode,
    resolve_memory,
)
from kvxferd.engine import EngineClient
from kvxferd.errors import InvalidRequest
from kvxferd.layout.presets import preset
from kvxferd.layout.spec import MemoryType
from kvxferd.pool import KVPool

PRESET = "dense:num_blocks=8,num_layers=2"
VRAM, DRAM = MemoryType.VRAM, MemoryType.DRAM


def _req(mode: MemoryMode, memory: MemoryType) -> AttachRequest:
    return AttachRequest(preset(PRESET), mode, memory)


def test_imported_vram_is_accepted_on_a_gpu_daemon_that_serves_kernel() -> None:
    memory, spec = resolve_memory(_req(MemoryMode.IMPORTED, VRAM), "cuda:0")
    assert memory is VRAM and all(r.memory is VRAM for r in spec.regions)


def test_imported_vram_needs_a_gpu_daemon() -> None:
    with pytest.raises(InvalidRequest, match=r"needs the daemon on a GPU.*pool.device = 'cpu'"):
        resolve_memory(_req(MemoryMode.IMPORTED, VRAM), "cpu")


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"cuda_ipc": False}, "this daemon's transfer.cuda_ipc = false"),
        ({"transfer_mode": "push"}, "this daemon is in push mode"),
    ],
    ids=["cuda-ipc-off", "push-mode"],
)
def test_imported_vram_is_refused_where_kernel_cannot_serve_it(
    kw: dict[str, object], needle: str
) -> None:
    with pytest.raises(InvalidRequest) as ei:
        resolve_memory(_req(MemoryMode.IMPORTED, VRAM), "cuda:0", **kw)  # type: ignore[arg-type]
    text = str(ei.value)
    assert "served by same-host KERNEL pulls only" in text and needle in text
    assert "0.5-0.6 GB/s" in text and "docs/attachment.md" in text
    assert "MEMORY_MODE_OWNED" in text and ei.value.field == "memory_mode"


@pytest.mark.parametrize(
    ("mode", "memory", "device"),
    [
        (MemoryMode.OWNED, VRAM, "cuda:0"),
        (MemoryMode.IMPORTED, DRAM, "cpu"),
        (MemoryMode.OWNED, DRAM, "cpu"),
    ],
)
def test_other_attaches_do_not_depend_on_kernel(
    mode: MemoryMode, memory: MemoryType, device: str
) -> None:
    got, _ = resolve_memory(_req(mode, memory), device, cuda_ipc=False, transfer_mode="push")
    assert got is memory


def test_only_imported_vram_is_kernel_only() -> None:
    pool = KVPool.allocate(preset(PRESET))
    assert not Built(pool, (), [], []).kernel_only
    forwarded = tuple((bytes(64), 0) for _ in pool.memory)
    assert Built(pool, (), [], [], forwarded).kernel_only


def test_the_engine_client_checks_its_tensors_device_before_sending() -> None:
    spec = preset(PRESET)
    cpu = KVPool.allocate(spec).tensors
    client = EngineClient("/nonexistent/kvxferd-engine.sock", timeout_s=1.0)
    try:
        with pytest.raises(InvalidRequest, match=r"is on cpu, but the attach is for cuda:0"):
            client.attach(spec, "imported", "cuda:0", tensors=cpu)
        with pytest.raises(InvalidRequest, match=r"no tensor for region"):
            client.attach(spec, "imported", "cuda:0", tensors={})
        meta = {n: torch.empty_like(t, device="meta") for n, t in cpu.items()}
        with pytest.raises(InvalidRequest, match=r"is on meta, but the attach is for cpu"):
            client.attach(spec, "imported", "cpu", tensors=meta)
    finally:
        client.close()
