"""The benchmark's baseline: one NIXL descriptor per (layer, block), between two processes.

The owner ("prefill") side is an :class:`~kvxferd.scenario.owner.OwnerProcess` holding the
per-layer tensors of a blocks-first pool on DRAM or a GPU; this process is the reader, with its
own agent and a :class:`~kvxferd.transfer.TransferEngine` that does not coalesce
(``coalesce=False``), fed a plan of one range per (layer, block) (:func:`per_block_plan`, which
the data-plane benchmark and the two-process tests use too).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.ranges import RegionRanges, TransferPlan
from kvxferd.scenario.owner import (
    OwnerCommand,
    OwnerProcess,
    OwnerSpec,
    cuda_index,
    mem_type,
    quiet_nixl,
)
from kvxferd.scenario.pattern import block_digests, region_rows

if TYPE_CHECKING:
    from kvxferd.nixl import NixlAgent
    from kvxferd.transfer import TransferEngine

Int64Array = npt.NDArray[np.int64]
START_TIMEOUT_S = 300.0
FLOOR_TIMEOUT_S = 600.0  # as the naive pull's engine allows


@dataclass(frozen=True)
class PoolShape:
    """``num_layers`` tensors of ``num_blocks`` blocks of ``block_bytes`` each."""

    num_layers: int
    num_blocks: int
    block_bytes: int

    @property
    def layer_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def per_block_plan(
    local: npt.ArrayLike, remote: npt.ArrayLike, *, num_layers: int, block_bytes: int
) -> TransferPlan:
    """One range of ``block_bytes`` per (layer, block pair): the vLLM connector's scheme."""
    lb = np.asarray(local, dtype=np.int64)
    rb = np.asarray(remote, dtype=np.int64)
    if lb.shape != rb.shape or lb.ndim != 1:
        raise ValueError("local and remote block lists must be 1-D of equal length")
    length = np.full(lb.shape, block_bytes, dtype=np.int64)
    lo, ro = lb * block_bytes, rb * block_bytes
    ranges = tuple(RegionRanges(r, f"layer.{r}", lo, ro, length) for r in range(num_layers))
    return TransferPlan(ranges, local_kernel_blocks=(lb,), naive_descriptors=num_layers * lb.size)


def naive_owner(name: str, shape: PoolShape, device: str, seed: int = 7) -> OwnerProcess:
    """The owner process of the baseline: ``shape``'s layers on ``device``, no lease table."""
    regions = (shape.layer_bytes,) * shape.num_layers
    spec = OwnerSpec(name, regions, seed=seed, device=device, leases=False)
    return OwnerProcess(spec, start_timeout_s=START_TIMEOUT_S)


@dataclass(frozen=True)
class NaiveResult:
    nbytes: int
    descriptors: int
    seconds: float
    post_seconds: float = 0.0  # of ``seconds``, the post call alone (the floor's READ only)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class NaiveReader:
    """This process's side: a pool on ``device``, an agent and a non-coalescing engine."""

    def __init__(self, name: str, shape: PoolShape, device: str, owner: OwnerProcess) -> None:
        import torch

        from kvxferd.nixl import AgentOptions, NixlAgent
        from kvxferd.transfer import EngineOptions, TransferEngine

        quiet_nixl()
        self.shape = shape
        self.device = device
        cuda = cuda_index(device)
        self.tensors = [
            torch.zeros(shape.layer_bytes, dtype=torch.uint8, device=device)
            for _ in range(shape.num_layers)
        ]
        self.agent: NixlAgent = NixlAgent(name, cuda_device=cuda, options=AgentOptions())
        self.agent.start()
        self.engine: TransferEngine | None = None
        try:
            regions = region_rows(self.tensors)
            self.agent.register(regions, mem_type(device))
            self.engine = TransferEngine(
                self.agent,
                regions,
                local_mem=mem_type(device),
                options=EngineOptions(
                    coalesce=False,
                    default_timeout_s=600.0,
                    max_inflight_bytes_per_peer=1 << 62,
                ),
            )
            self.engine.start()
            self.engine.connect_peer(owner.name, owner.metadata, owner.regions, owner.mem)
        except BaseException:
            self.close()
            raise
        self.owner = owner
        self._n = 0

    def pull(self, local: Int64Array, remote: Int64Array) -> NaiveResult:
        from kvxferd.transfer import TransferStatus

        assert self.engine is not None
        plan = per_block_plan(
            local, remote, num_layers=self.shape.num_layers, block_bytes=self.shape.block_bytes
        )
        self._n += 1
        t0 = time.perf_counter()
        res = self.engine.submit(f"naive-{self._n}", self.owner.name, plan).result(600)
        dt = time.perf_counter() - t0
        if res.status is not TransferStatus.DONE:
            raise RuntimeError(f"naive transfer ended {res.status.value}: {res.reason}")
        return NaiveResult(res.nbytes, res.descriptors, dt)

    def floor(self, local: Int64Array, remote: Int64Array) -> NaiveResult:
        """The bare-NIXL floor of a DIRECT pull: the descriptors DIRECT would post (the naive
        plan's ranges coalesced where contiguous on both sides, as the daemon builds them),
        posted as one READ by the raw agent and polled in a plain loop (no engine, no daemon).

        The loop runs on the agent's NIXL thread (kvxferd/nixl/worker.py), where the agent's
        calls run inline: polled from this thread, every poll was a hand-off to that thread and
        back, and a loop of them held the interpreter against the thread doing the work, so
        the "floor" ran slower than the daemon's own READ of the same descriptors."""
        from kvxferd.nixl import XferOp, XferState
        from kvxferd.transfer.descriptors import RegionTable, build_descriptors

        plan = per_block_plan(
            local, remote, num_layers=self.shape.num_layers, block_bytes=self.shape.block_bytes
        )
        loc, rem = build_descriptors(
            plan,
            RegionTable.from_array(region_rows(self.tensors)),
            RegionTable.from_array(self.owner.regions),
            merge=True,
        )
        mem = mem_type(self.device)
        agent, peer, remote_mem = self.agent, self.owner.name, self.owner.mem

        def read() -> tuple[float, float]:  # on the NIXL thread
            t0 = time.perf_counter()
            h = agent.post(XferOp.READ, loc, rem, peer=peer, local_mem=mem, remote_mem=remote_mem)
            t1 = time.perf_counter()
            try:
                while agent.poll(h) is not XferState.DONE:
                    if time.perf_counter() - t0 > FLOOR_TIMEOUT_S:
                        raise TimeoutError(f"the floor's READ did not end in {FLOOR_TIMEOUT_S}s")
                return time.perf_counter() - t0, t1 - t0
            finally:
                agent.release(h)

        dt, post = self.agent.submit(read).result()
        return NaiveResult(int(loc[:, 1].sum()), int(loc.shape[0]), dt, post)

    def verify(self, local: Int64Array, remote: Int64Array, samples: int, seed: int) -> int:
        """Compare ``samples`` random (layer, block) pairs with the owner; return mismatches."""
        rng = np.random.default_rng(seed)
        bad = 0
        pick = rng.choice(local.size, size=min(samples, local.size), replace=False)
        for layer in sorted(set(int(x) for x in rng.integers(self.shape.num_layers, size=4))):
            bb = self.shape.block_bytes
            mine = block_digests(self.tensors[layer], local[pick], bb)
            theirs = self.owner.call(OwnerCommand.DIGESTS, layer, remote[pick], bb, timeout_s=120)
            bad += sum(1 for a, b in zip(mine, theirs, strict=True) if a != b)
        return bad

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.agent.close()
