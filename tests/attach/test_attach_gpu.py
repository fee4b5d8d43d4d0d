"""GPU: OWNED VRAM export over CUDA IPC (the fast path). Skipped without CUDA; the device run
executes them. IMPORTED VRAM (served by KERNEL only): tests/attach/test_imported_vram_gpu.py.

An attached daemon on cuda:0 allocates the pool, exports CUDA IPC handles; the engine process
maps them and stamps every block on the GPU; an owned VRAM decode daemon on the same GPU
pulls; Checksum digests of both sides must agree.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvxferd.scenario.daemons import DaemonOptions, DaemonSet
from kvxferd.v1 import engine_pb2
from tests.attach.test_attach import PRESET, Engine, _pull_and_verify, _state
from tests.service.conftest import Daemon, Daemons

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def gpu_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    ds = DaemonSet(
        tmp_path_factory.mktemp("attach-gpu"),
        [
            DaemonOptions(
                "att",
                PRESET,
                device="cuda:0",
                extra=("--set", "pool.mode=attached"),
            ),
            DaemonOptions("decode", PRESET, device="cuda:0"),
        ],
    )
    try:
        ds.start()
        ds.wait_ready()
    except BaseException:
        ds.stop()
        raise
    d = Daemons(ds)
    yield d["att"], d["decode"]
    d.stop()


def test_vram_attach_over_cuda_ipc_and_pull(gpu_pair: tuple[Daemon, Daemon]) -> None:
    att, decode = gpu_pair
    eng = Engine(att.engine_socket, "--device", "cuda:0", "--request", "gpu-owned")
    try:
        out = eng.line(timeout_s=180)
        pool = _state(att)
        assert pool.state == engine_pb2.REGISTRATION_STATE_REGISTERED
        assert pool.exports and all(len(h.cuda_ipc_handle) == 64 for h in pool.exports)
        _pull_and_verify(att, decode, out["ticket"], [20, 21, 22, 23])
        eng.detach()
        assert _state(att).state == engine_pb2.REGISTRATION_STATE_DETACHED
    finally:
        eng.kill()
