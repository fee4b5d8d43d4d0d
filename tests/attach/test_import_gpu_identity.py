"""Which GPU an engine's IMPORTED VRAM is on, as the daemon decides it: by the GPU's UUID, since
two processes with different CUDA_VISIBLE_DEVICES number the same GPU differently; by ordinal
only for an engine that sends no UUID (older) or a driver that reports none.

CPU only: the device facts (this process's UUID of an ordinal) are stand-ins. The GPU path
(mapping the handle on the ordinal chosen here) runs in tests/attach/test_imported_vram_gpu.py
on a GPU machine with one CUDA_VISIBLE_DEVICES for both processes; two numberings were not run.
"""

from __future__ import annotations

import pytest

from kvxferd.daemon.attach_memory import ImportHandle, import_ordinal
from kvxferd.errors import InvalidRequest
from kvxferd.layout.presets import preset
from kvxferd.service.attaching import attach_request_from_proto
from kvxferd.v1 import engine_pb2
from kvxferd.wire.codec import spec_to_proto

GPU0 = "GPU-0a0a0a0a-0000-0000-0000-000000000000"
GPU2 = "GPU-2c2c2c2c-2222-2222-2222-222222222222"
# The daemon sees all four GPUs; an engine started with CUDA_VISIBLE_DEVICES=2 calls GPU2 cuda:0.
DAEMON_GPUS = {0: GPU0, 1: None, 2: GPU2, 3: None}


def _handle(engine_ordinal: int, uuid: str) -> ImportHandle:
    return ImportHandle("layer.0", cuda_ipc_handle=b"\x01" * 64, device=engine_ordinal,
                        device_uuid=uuid)  # fmt: skip


def test_the_same_gpu_under_another_numbering_opens_on_the_daemons_ordinal() -> None:
    h = _handle(0, GPU2)  # the engine's cuda:0 is the daemon's cuda:2
    assert import_ordinal(h, "cuda:2", "imports[0]", DAEMON_GPUS.get) == 2


def test_another_gpu_with_the_same_ordinal_is_refused_naming_both() -> None:
    h = _handle(0, GPU2)  # the engine's cuda:0 (GPU2) is not the daemon's cuda:0 (GPU0)
    with pytest.raises(InvalidRequest) as ei:
        import_ordinal(h, "cuda:0", "imports[0]", DAEMON_GPUS.get)
    text = str(ei.value)
    assert f"on GPU {GPU2} (the engine's cuda:0)" in text and f"which is GPU {GPU0}" in text
    assert "CUDA_VISIBLE_DEVICES" in text and "nvidia-smi -L" in text
    assert ei.value.field == "imports.device_uuid"


def test_uuids_compare_without_case() -> None:
    assert import_ordinal(_handle(0, GPU2.upper()), "cuda:2", "r", DAEMON_GPUS.get) == 2


def test_an_engine_without_a_uuid_keeps_the_ordinal_comparison() -> None:
    assert import_ordinal(_handle(1, ""), "cuda:1", "r", DAEMON_GPUS.get) == 1
    with pytest.raises(InvalidRequest, match=r"on cuda:0, the daemon runs on cuda:2") as ei:
        import_ordinal(_handle(0, ""), "cuda:2", "r", DAEMON_GPUS.get)
    assert "MemoryHandle.device_uuid" in str(ei.value) and ei.value.field == "imports.device_id"


def test_a_driver_without_uuids_falls_back_to_the_ordinal() -> None:
    assert import_ordinal(_handle(3, GPU2), "cuda:3", "r", DAEMON_GPUS.get) == 3  # None here
    with pytest.raises(InvalidRequest, match="on cuda:0, the daemon runs on cuda:1"):
        import_ordinal(_handle(0, GPU2), "cuda:1", "r", DAEMON_GPUS.get)


def test_the_uuid_crosses_the_wire_into_the_import() -> None:
    msg = engine_pb2.AttachRequest(
        spec=spec_to_proto(preset("dense:num_blocks=8,num_layers=1")),
        memory_mode=engine_pb2.MEMORY_MODE_IMPORTED,
    )
    msg.imports.append(
        engine_pb2.MemoryHandle(
            region_name="layer.0", cuda_ipc_handle=b"\x01" * 64, device_id=0, device_uuid=GPU2
        )
    )
    (h,) = attach_request_from_proto(msg).imports
    assert (h.device, h.device_uuid) == (0, GPU2)
