"""Two real daemons whose kernel block sizes differ (16 and 32 tokens, logical blocks of 64):
the handshake accepts them, the pull re-blocks at 16-token chunks (docs/domain.md §5 rule 3),
and the decode daemon's blocks end up exactly as the plan says, checked through Checksum
against the prefill pool rebuilt in this process from the same pattern."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from kvxferd.blocks import plan_pull
from kvxferd.blocks.ranges import PullPlan
from kvxferd.layout import preset
from kvxferd.pool import KVPool
from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import engine_pb2, scheduler_pb2
from kvxferd.wire.codec import group_ids_to_proto
from tests.service.conftest import Daemon, launch
from tests.service.test_service_pull import Client

SHAPE = "num_blocks=8,attention_layers=2,mamba_layers=1,head_size=16"
PREFILL = f"hybrid:kernel_block_size=16,ppl=4,{SHAPE}"
DECODE = f"hybrid:kernel_block_size=32,ppl=2,{SHAPE}"
SEED = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Daemon]]:
    ds = launch(
        tmp_path_factory.mktemp("reblock"),
        DaemonOptions("prefill", PREFILL, prefix_caching=True, fill_seed=SEED),
        DaemonOptions("decode", DECODE, prefix_caching=True),
    )
    yield ds["prefill"], ds["decode"]
    ds.stop()


def _filled(text: str, seed: int | None) -> KVPool:
    pool = KVPool.allocate(preset(text))
    if seed is not None:
        for g in range(len(pool.spec.groups)):
            pool.fill_pattern(g, range(pool.spec.num_kernel_blocks(g)), seed)
    return pool


def _apply(plan: PullPlan, local: KVPool, remote: KVPool) -> None:
    """Run the plan on raw region bytes (the planner's own contract, as the executor in the
    block tests does), writing into ``local``'s tensors."""
    dst = [
        torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,))
        .view(torch.uint8)
        .numpy()
        for t in (local.tensors[r.name] for r in local.spec.regions)
    ]
    src = [
        torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,))
        .view(torch.uint8)
        .numpy()
        for t in (remote.tensors[r.name] for r in remote.spec.regions)
    ]
    for part in plan.per_rank.values():
        for rg in part.ranges:
            for lo, ro, n in zip(
                rg.local_offset.tolist(),
                rg.remote_offset.tolist(),
                rg.length.tolist(),
                strict=True,
            ):
                dst[rg.region][lo : lo + n] = src[rg.region][ro : ro + n]


def test_pull_between_kernel_block_sizes_16_and_32_lands_the_planned_bytes(
    pair: tuple[Daemon, Daemon],
) -> None:
    remote_ids, local_ids = [[5, 2, 7], [6]], [[1, 4], [3]]  # a one-block cached prefix
    remote, local = _filled(PREFILL, SEED), _filled(DECODE, None)
    plan = plan_pull(local.spec, remote.spec, local_ids, remote_ids, prefix_caching=True)
    _apply(plan, local, remote)
    kernel = [int(b) for b in plan.local_kernel_blocks[0]]
    assert kernel == [2, 3, 8, 9]  # logical 1 and 4 at ppl 2
    want = local.checksums(0, kernel)
    want_state = local.checksums(1, [3])

    async def go() -> None:
        c = Client(*pair)
        before = await c.digests(c.decode, kernel)
        held = await c.engine.Hold(
            engine_pb2.HoldRequest(request_id="reblock-1", block_ids=group_ids_to_proto(remote_ids))
        )
        resp = await c.decode.StartPull(
            scheduler_pb2.StartPullRequest(
                request_id=held.request_id,
                peer_address=held.peer_address,
                remote_block_ids=held.remote_block_ids,
                local_block_ids=group_ids_to_proto(local_ids),
            )
        )
        done = await c.wait(resp.status.transfer_id)
        assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
        assert done.nbytes == plan.nbytes
        assert done.descriptors_before_coalescing == plan.naive_descriptors
        got = await c.digests(c.decode, kernel)
        assert got == want
        assert got != before
        state = await c.decode.Checksum(
            scheduler_pb2.ChecksumRequest(group_index=1, block_ids=[3], kernel_block_ids=True)
        )
        assert list(state.digests) == want_state

    asyncio.run(go())
