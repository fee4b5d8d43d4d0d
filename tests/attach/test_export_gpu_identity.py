"""Which GPU a daemon's OWNED VRAM export is on, as the engine decides it when it maps the
export (kvxferd.engine.client.export_ordinal): by the GPU's UUID the daemon sends, since the
daemon and the engine may number GPUs differently (CUDA_VISIBLE_DEVICES); by the daemon's
ordinal only when no UUID came (an older daemon, or a driver that reports none).

CPU only: the device facts are stand-ins. The mapping itself runs in the GPU tests of
tests/attach on a machine where both processes number the GPUs alike; two numberings were not
run.
"""

from __future__ import annotations

import pytest

from kvxferd.daemon.attach_memory import ExportHandle
from kvxferd.engine.client import export_ordinal
from kvxferd.errors import InvalidRequest
from kvxferd.service.attaching import _export_to_proto
from kvxferd.v1 import engine_pb2

GPU1 = "GPU-1b1b1b1b-1111-1111-1111-111111111111"
GPU3 = "GPU-3d3d3d3d-3333-3333-3333-333333333333"
# An engine started with CUDA_VISIBLE_DEVICES=3,1 calls GPU3 cuda:0 and GPU1 cuda:1.
ENGINE_GPUS = {GPU3.lower(): 0, GPU1.lower(): 1}


def _engine_ordinal(uuid: str) -> int | None:
    return ENGINE_GPUS.get(uuid.lower())


def _export(daemon_ordinal: int, uuid: str) -> engine_pb2.MemoryHandle:
    return engine_pb2.MemoryHandle(
        region_name="layer.0",
        cuda_ipc_handle=b"\x01" * 64,
        device_id=daemon_ordinal,
        device_uuid=uuid,
        nbytes=1 << 20,
    )


def test_the_daemons_gpu_opens_on_the_engines_own_ordinal_of_it() -> None:
    assert export_ordinal(_export(3, GPU3), _engine_ordinal) == 0  # daemon cuda:3 = engine cuda:0
    assert export_ordinal(_export(1, GPU1.upper()), _engine_ordinal) == 1


def test_a_gpu_the_engine_does_not_see_is_refused_naming_it() -> None:
    with pytest.raises(InvalidRequest) as ei:
        export_ordinal(_export(0, "GPU-00000000-0000-0000-0000-000000000000"), _engine_ordinal)
    assert "GPU-00000000" in ei.value.message and "does not see" in ei.value.message
    assert "CUDA_VISIBLE_DEVICES" in (ei.value.fix or "")


def test_an_export_without_a_uuid_keeps_the_daemons_ordinal() -> None:
    assert export_ordinal(_export(2, ""), _engine_ordinal) == 2


def test_the_uuid_crosses_the_wire_with_the_export() -> None:
    h = _export_to_proto(ExportHandle("layer.0", 256, 1 << 20, 3, cuda_ipc_handle=b"\x02" * 64,
                                      device_uuid=GPU3))  # fmt: skip
    assert h.device_uuid == GPU3 and h.device_id == 3 and h.offset == 256
    shm = _export_to_proto(ExportHandle("layer.0", 0, 1 << 20, 0, shm_name="/kvx-seg"))
    assert shm.device_uuid == "" and shm.shm_name == "/kvx-seg"
