"""Push mode with pools in VRAM: the prefill daemon WRITEs into GPU memory over NIXL.

Both pairs (push, and pull forced DIRECT: NIXL WRITE against NIXL READ, same blocks) on
``cuda:0``, or prefill on ``cuda:0`` and decode on ``cuda:1`` when there are two GPUs; bytes
verified through Checksum; the StartPull-to-terminal times of both modes are printed (``-s``).
Skipped without CUDA.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Iterator

import pytest
import torch

from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import scheduler_pb2
from tests.push.client import Client
from tests.push.conftest import mode_config
from tests.service.conftest import Daemons, launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]
PRESET = "dense:num_blocks=256"


@pytest.fixture(scope="module")
def vram(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    tmp = tmp_path_factory.mktemp("push-gpu")
    decode_dev = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    # The pull pair READs with NIXL too (DIRECT), as the push pair WRITEs.
    on, off = mode_config(tmp, "push"), mode_config(tmp, "pull", "direct")
    ds = launch(
        tmp,
        DaemonOptions("prefill", PRESET, device="cuda:0", fill_seed=6, extra=on),
        DaemonOptions("decode", PRESET, device=decode_dev, extra=on),
        DaemonOptions("pull-prefill", PRESET, device="cuda:0", fill_seed=6, extra=off),
        DaemonOptions("pull-decode", PRESET, device=decode_dev, extra=off),
    )
    yield ds
    ds.stop()


def test_push_into_vram_is_byte_exact(vram: Daemons) -> None:
    async def go() -> None:
        c = Client(vram["prefill"], vram["decode"])
        rng = random.Random(3)
        remote, local = rng.sample(range(256), 100), rng.sample(range(256), 100)
        done = await c.pull(await c.hold("gpu-push", [remote]), [local])
        assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
        assert "push mode" in done.strategy_reason
        assert await c.same([remote], [local])

    asyncio.run(go())


@pytest.mark.parametrize("blocks", [16, 128])
def test_push_and_pull_times_in_vram(vram: Daemons, blocks: int) -> None:
    """The same contiguous pulls in both modes, byte-exact; p50 and p90 printed."""

    async def times(prefill: str, decode: str, tag: str) -> list[float]:
        c = Client(vram[prefill], vram[decode])
        out = []
        stages: dict[str, list[float]] = {}
        for i in range(12):
            remote = list(range(blocks))
            local = list(range(256 - blocks, 256))
            done = await c.pull(await c.hold(f"{tag}-{blocks}-{i}", [remote]), [local])
            assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
            out.append((done.finished_unix_ns - done.created_unix_ns) / 1e6)
            if i == 0:
                assert await c.same([remote], [local])
            elif i >= 2:  # the first pulls handshake and warm up
                for s in done.stages:
                    stages.setdefault(s.name, []).append(s.seconds * 1e3)
        print(
            f"\n{tag} {blocks} blocks, stage p50 ms: "
            + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in stages.items())
        )
        return out[2:]

    async def go() -> None:
        for mode, (p, d) in (
            ("push", ("prefill", "decode")),
            ("pull", ("pull-prefill", "pull-decode")),
        ):
            ms = sorted(await times(p, d, mode))
            mib = blocks * 2
            p50 = statistics.median(ms)
            print(
                f"\n{mode} {blocks} blocks ({mib} MiB) in VRAM: p50 {p50:.2f} ms,"
                f" p90 {ms[int(len(ms) * 0.9) - 1]:.2f} ms, {mib / 1024 / (p50 / 1e3):.1f} GiB/s"
            )

    asyncio.run(go())
