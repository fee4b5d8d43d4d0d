"""The owner process the benchmarks and two-process tests share: a real spawned process with its
own NIXL agent, answering over a pipe."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvxferd.scenario.owner import OwnerCommand, OwnerProcess, OwnerSpec, cuda_index
from kvxferd.scenario.pattern import block_digests, fill_pattern

BLOCK = 4096


@pytest.fixture(scope="module")
def owner() -> Iterator[OwnerProcess]:
    o = OwnerProcess(OwnerSpec("scenario-owner", (8 * BLOCK, 4 * BLOCK), seed=3, leases=False))
    yield o
    o.close()


def test_hello_names_the_agent_and_its_regions(owner: OwnerProcess) -> None:
    assert owner.name == "scenario-owner" and owner.metadata
    assert owner.regions[:, 1].tolist() == [8 * BLOCK, 4 * BLOCK]
    assert owner.pid > 0 and owner.proc.is_alive()


@pytest.mark.parametrize("region", [0, 1])
def test_digests_are_those_of_the_pattern(owner: OwnerProcess, region: int) -> None:
    mine = torch.zeros(int(owner.regions[region, 1]), dtype=torch.uint8)
    fill_pattern(mine, 3, region)
    blocks = [3, 0, 2]
    theirs = owner.call(OwnerCommand.DIGESTS, region, blocks, BLOCK)
    assert theirs == block_digests(mine, blocks, BLOCK)
    other = torch.zeros_like(mine)
    fill_pattern(other, 4, region)  # another seed: every block differs
    assert all(a != b for a, b in zip(theirs, block_digests(other, blocks, BLOCK), strict=True))


def test_an_unknown_command_is_refused_with_the_known_ones(owner: OwnerProcess) -> None:
    with pytest.raises(ValueError, match=r"unknown owner command 'sum'.*digests"):
        owner.call("sum", 0, [0], 8)
    assert owner.call(OwnerCommand.RELEASED) == []  # still answering


def test_an_owner_that_cannot_start_says_why() -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA to fail the start")
    with pytest.raises(RuntimeError, match="failed to start"):
        OwnerProcess(OwnerSpec("no-gpu-owner", (BLOCK,), device="cuda:0"), start_timeout_s=60)


def test_cuda_index() -> None:
    assert (cuda_index("cpu"), cuda_index("cuda"), cuda_index("cuda:3")) == (None, 0, 3)
