"""GPU: the vLLM connector's GPU attach path against real daemons, without vLLM (none runs on
the machines here). Skipped without CUDA.

Two engine processes (tests/vllm/gpu_engine.py) allocate their KV cache on cuda:0 as vLLM 0.32's
worker does and attach it through the connector's own code (``attach_cuda``: describe, CUDA
IPC export, IMPORTED VRAM) to an attached daemon each. The prefill engine holds a request
through the connector's ``EngineLink.hold``; the decode engine pulls it through the
connector's ``PullLink`` on its own daemon. The pull must be KERNEL, and the Checksum digests
of the pulled blocks must equal the held ones (and differ before the pull). Refusals: a daemon
on the CPU, and PyTorch's expandable segments, each at start with the fix and docs/vllm.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.lineproc import LineProcess
from tests.service.conftest import Daemon, Daemons, launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[2]
PRESET = "dense:num_blocks=64"  # what an attached daemon starts with; the engine's spec wins
ATTACHED = ("--set", "pool.mode=attached")


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    ds = launch(
        tmp_path_factory.mktemp("vllm-gpu"),
        DaemonOptions("prefill", PRESET, device="cuda:0", extra=ATTACHED),
        DaemonOptions("decode", PRESET, device="cuda:0", extra=ATTACHED),
        DaemonOptions("cpu", PRESET, extra=ATTACHED),
    )
    yield ds
    ds.stop()


class GpuEngine(LineProcess):
    """One tests/vllm/gpu_engine.py process and its JSON lines."""

    LINE_TIMEOUT_S = 120.0

    def __init__(self, socket: str, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__("tests.vllm.gpu_engine", socket, *args, env=env)

    def ask(self, **cmd: Any) -> dict[str, Any]:
        self.send(json.dumps(cmd))
        return self.line()


def _sched(d: Daemon) -> scheduler_pb2_grpc.SchedulerStub:
    return scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(d.grpc))


def _digests(d: Daemon, ids: list[int]) -> list[bytes]:
    req = scheduler_pb2.ChecksumRequest(group_index=0, block_ids=ids, kernel_block_ids=True)
    return list(_sched(d).Checksum(req).digests)


@pytest.mark.parametrize("layout", ["LBHNC", "BLNHC"])
def test_vllm_gpu_cache_is_held_and_pulled_with_kernel_byte_exact(
    daemons: Daemons, layout: str
) -> None:
    prefill, decode = daemons["prefill"], daemons["decode"]
    owner = GpuEngine(prefill.engine_socket, "--layout", layout, "--seed", "11")
    reader = GpuEngine(decode.engine_socket, "--layout", layout, "--seed", "12")
    try:
        a, b = owner.line(), reader.line()
        assert "attached" in a, a
        assert "attached" in b, b
        assert (
            a["attached"]["model"] == f"tiny-gpu [vllm-kv layout={layout} backend=FLASH_ATTN tp=1]"
        )
        assert all("VRAM" in r for r in a["attached"]["regions"])
        remote, local = [3, 9, 10, 40], [5, 6, 50, 61]
        assert _digests(prefill, remote) != _digests(decode, local)  # different seeds
        ticket = owner.ask(op="hold", request_id=f"vllm-gpu-{layout}", blocks=remote)["ticket"]
        pulled = reader.ask(op="pull", ticket=ticket, local=local)["pulled"]
        assert pulled["state"] == "DONE", pulled
        st = (
            _sched(decode)
            .GetTransfer(scheduler_pb2.GetTransferRequest(transfer_id=pulled["transfer_id"]))
            .status
        )
        assert st.strategy == scheduler_pb2.TRANSFER_STRATEGY_KERNEL, st.strategy_reason
        assert _digests(decode, local) == _digests(prefill, remote)
        released = owner.line()  # the reader's confirmation releases the hold
        assert released == {"released": f"vllm-gpu-{layout}", "reason": "DONE"}
        assert owner.ask(op="detach") == {"detached": True}
        assert reader.ask(op="detach") == {"detached": True}
        assert owner.proc.wait(30) == 0 and reader.proc.wait(30) == 0
    finally:
        owner.kill()
        reader.kill()


def test_a_daemon_not_on_the_gpu_is_refused_at_start_with_the_fix(daemons: Daemons) -> None:
    eng = GpuEngine(daemons["cpu"].engine_socket)
    try:
        err = eng.line()["error"]
        assert "a VRAM pool needs the daemon on a GPU" in err, err
        assert "pool.device = cuda:0" in err
        assert "docs/vllm.md" in err
        assert eng.proc.wait(30) == 3
    finally:
        eng.kill()


def test_expandable_segments_are_refused_at_start_with_the_fix(daemons: Daemons) -> None:
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    eng = GpuEngine(daemons["prefill"].engine_socket, env=env)
    try:
        err = eng.line()["error"]
        assert "expandable segments" in err, err
        assert "unset expandable_segments in PYTORCH_CUDA_ALLOC_CONF" in err
        assert "docs/vllm.md" in err
        assert eng.proc.wait(30) == 3
    finally:
        eng.kill()


def test_expandable_segment_memory_itself_cannot_be_exported() -> None:
    """Past the configuration check: the export of such memory fails, and says so."""
    code = (
        "import torch\n"
        "from kvxferd.vllm.gpu import cuda_imports\n"
        "from kvxferd.vllm.tensors import describe\n"
        "from tests.vllm.gpu_engine import vllm_kv_cache\n"
        "cfg, raw, views = vllm_kv_cache('LBHNC', 'cuda:0')\n"
        "try:\n"
        "    cuda_imports(describe(cfg, views, model='m'))\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n"
        "else:\n"
        "    print('exported')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        },
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = out.stdout + out.stderr
    assert "SpecError" in text and "cannot be exported over CUDA IPC" in text, text
    assert "docs/vllm.md" in text
