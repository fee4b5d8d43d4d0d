"""Fixtures for two-process tests: a spawned owner (kvxferd.scenario.owner), readers here."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvxferd.nixl import AgentOptions, MemType, NixlAgent
from kvxferd.scenario.owner import OwnerProcess, OwnerSpec
from kvxferd.transfer import EngineOptions, TransferEngine

REGION = 1 << 20
BLOCK = 4096
_names = itertools.count()


@dataclass
class Reader:
    agent: NixlAgent
    engine: TransferEngine
    buffers: list[torch.Tensor]

    def words(self, region: int) -> np.ndarray:
        return self.buffers[region].view(torch.int64).numpy()

    def connect(self, owner: OwnerProcess) -> None:
        self.engine.connect_peer(owner.name, owner.metadata, owner.regions)
        owner.call("add_remote", self.agent.name, self.agent.metadata())


def make_reader(
    num_regions: int = 2, region_bytes: int = REGION, options: EngineOptions | None = None
) -> Reader:
    agent = NixlAgent(f"reader{next(_names)}", options=AgentOptions(idle_poll_s=0.005))
    agent.start()
    bufs = [torch.zeros(region_bytes, dtype=torch.uint8) for _ in range(num_regions)]
    regions = np.array([[b.data_ptr(), b.numel(), 0] for b in bufs], dtype=np.int64)
    agent.register(regions, MemType.DRAM)
    engine = TransferEngine(agent, regions, options=options)
    engine.start()
    return Reader(agent, engine, bufs)


def close_reader(r: Reader) -> None:
    r.engine.close()
    r.agent.close()


@pytest.fixture(scope="module")
def owner() -> Iterator[OwnerProcess]:
    o = OwnerProcess(OwnerSpec(f"owner{next(_names)}", (REGION, REGION)))
    yield o
    o.close()


@pytest.fixture(scope="module")
def reader(owner: OwnerProcess) -> Iterator[Reader]:
    r = make_reader()
    r.connect(owner)
    yield r
    close_reader(r)


@pytest.fixture
def spawn_owner() -> Iterator[type[OwnerProcess]]:
    """Owners a test may kill or stop; all are reaped afterwards."""
    made: list[OwnerProcess] = []

    class _Owner(OwnerProcess):
        def __init__(self, spec: OwnerSpec, *, wait: bool = True) -> None:
            made.append(self)
            super().__init__(spec, wait=wait)

    yield _Owner
    for o in made:
        o.close()
