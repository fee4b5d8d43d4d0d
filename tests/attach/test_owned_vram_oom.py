"""An OWNED VRAM Attach whose pool the GPU cannot hold is refused as RESOURCE_EXHAUSTED in one
line naming the bytes asked for and the fix, as an OWNED DRAM Attach larger than /dev/shm is
(test_shm_room.py).

Before: torch's OutOfMemoryError left build_memory as it was, and the engine got an INTERNAL
error. There is no GPU to exhaust here: KVPool.allocate is faked to raise the
torch.OutOfMemoryError CUDA's caching allocator raises (a GPU daemon is what serves this for
real; build_memory is what its Attach runs)."""

from __future__ import annotations

import grpc
import pytest
import torch

from kvxferd.daemon.attach_memory import AttachRequest, MemoryMode, build_memory
from kvxferd.errors import ResourceExhausted
from kvxferd.layout.presets import preset
from kvxferd.layout.spec import KVCacheSpec, MemoryType
from kvxferd.pool import KVPool
from kvxferd.wire.errors import status_for


def test_an_owned_vram_pool_out_of_gpu_memory_is_resource_exhausted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def oom(cls: type[KVPool], spec: KVCacheSpec, device: str = "cpu") -> KVPool:
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of"
            " 79.19 GiB of which 1.00 GiB is free.\nOf the allocated memory ..."
        )

    monkeypatch.setattr(KVPool, "allocate", classmethod(oom))
    spec = preset("dense:num_blocks=1024").with_memory(MemoryType.VRAM)
    req = AttachRequest(spec=spec, mode=MemoryMode.OWNED, memory=MemoryType.VRAM)
    with pytest.raises(ResourceExhausted) as err:
        build_memory(spec, req, "a" * 32, device="cuda:0", instance_id="b" * 32)
    text = str(err.value)
    assert f"needs {spec.nbytes} bytes on cuda:0" in text and "CUDA out of memory" in text, text
    assert "\n" not in text and "fewer blocks" in err.value.fix, text
    assert "free memory on cuda:0" in err.value.fix, err.value.fix
    assert status_for(err.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
