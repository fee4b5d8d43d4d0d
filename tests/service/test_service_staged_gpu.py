"""A STAGED pull between two daemons whose pools and staging rings live in VRAM.

Prefill on ``cuda:0``, decode on ``cuda:1`` when there are two GPUs (else both on ``cuda:0``);
bytes verified through Checksum. Skipped without CUDA.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest
import torch

from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import scheduler_pb2
from tests.service.conftest import Daemons, launch
from tests.service.test_service_staged import ROW, Client, _staging

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
]


@pytest.fixture(scope="module")
def vram(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    decode_dev = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    ds = launch(
        tmp_path_factory.mktemp("staged-gpu"),
        DaemonOptions(
            "prefill",
            "dense:num_blocks=256",
            device="cuda:0",
            fill_seed=6,
            extra=_staging("auto", 8 * ROW, 4),
        ),
        DaemonOptions(
            "decode",
            "dense:num_blocks=256",
            device=decode_dev,
            extra=_staging("staged", 8 * ROW, 4),
        ),
    )
    yield ds
    ds.stop()


def test_staged_pull_in_vram_is_byte_exact(vram: Daemons) -> None:
    async def go() -> None:
        c = Client(vram["prefill"], vram["decode"])
        rng = random.Random(3)
        remote, local = rng.sample(range(256), 100), rng.sample(range(256), 100)
        st = await c.pull(await c.hold("gpu-staged", [remote]), [local])
        assert st.state == scheduler_pb2.TRANSFER_STATE_DONE, st.error.message
        assert st.strategy == scheduler_pb2.TRANSFER_STRATEGY_STAGED, st.strategy_reason
        assert st.stage_times.chunks == 13
        assert await c.same([remote], [local])

    asyncio.run(go())
