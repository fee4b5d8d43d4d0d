"""The benchmark's baseline: one NIXL descriptor per (layer, block), between two processes.

The same machinery as :mod:`bench.dataplane` and :mod:`bench.peer` (which are not part of the
installed package), extended to GPU memory: an owner ("prefill") process started with
multiprocessing ``spawn`` allocates the per-layer tensors of a blocks-first pool, fills them,
registers them with its own :class:`~kvxferd.nixl.NixlAgent` and answers commands over a pipe;
this process is the reader, with its own agent and a :class:`~kvxferd.transfer.TransferEngine`
that does not coalesce (``coalesce=False``), fed a plan of one range per (layer, block). The
pipe is plumbing between processes this module starts; nothing here is the daemon's wire.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.ranges import RegionRanges, TransferPlan

if TYPE_CHECKING:
    import torch

    from kvxferd.nixl import NixlAgent
    from kvxferd.transfer import TransferEngine

Int64Array = npt.NDArray[np.int64]
START_TIMEOUT_S = 300.0


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


def block_digests(
    tensors: list[torch.Tensor], layer: int, blocks: Int64Array, bb: int
) -> list[str]:
    """BLAKE2b-64 hex digests of blocks of one layer's byte tensor (copied to the host)."""
    import torch

    rows = tensors[layer].view(-1, bb)
    picked = rows[torch.from_numpy(np.asarray(blocks, dtype=np.int64)).to(rows.device)].cpu()
    return [hashlib.blake2b(r.numpy().tobytes(), digest_size=8).hexdigest() for r in picked]


def _allocate(shape: PoolShape, device: str) -> list[torch.Tensor]:
    import torch

    return [
        torch.zeros(shape.layer_bytes, dtype=torch.uint8, device=device)
        for _ in range(shape.num_layers)
    ]


def _fill(tensors: list[torch.Tensor], shape: PoolShape, seed: int) -> None:
    """A pattern distinct per (layer, block): every 8-byte word encodes seed, layer, word."""
    import torch

    for layer, t in enumerate(tensors):
        words = t.view(torch.int64)
        idx = torch.arange(words.numel(), dtype=torch.int64, device=t.device)
        words.copy_(idx * 0x9E3779B1 + ((seed << 48) + (layer << 40) + 1))


def _region_rows(tensors: list[torch.Tensor]) -> Int64Array:
    return np.array(
        [[t.data_ptr(), t.numel(), t.device.index or 0] for t in tensors], dtype=np.int64
    )


def _mem_type(device: str) -> Any:
    from kvxferd.nixl import MemType

    return MemType.VRAM if device.startswith("cuda") else MemType.DRAM


def _cuda_index(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    _, _, idx = device.partition(":")
    return int(idx or 0)


def _quiet_nixl() -> None:
    """NIXL logs INFO lines to stdout (its own handler); keep the report clean unless the
    user asked for a level with ``NIXL_LOG_LEVEL``."""
    import kvxferd.nixl  # noqa: F401  (configures the "nixl" logger)

    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)


def _owner_main(name: str, shape: PoolShape, device: str, seed: int, conn: Connection) -> None:
    import torch

    from kvxferd.nixl import AgentOptions, NixlAgent

    _quiet_nixl()
    cuda = _cuda_index(device)
    if cuda is not None:
        torch.cuda.set_device(cuda)
    agent = NixlAgent(name, cuda_device=cuda, options=AgentOptions())
    try:
        agent.start()
        tensors = _allocate(shape, device)
        _fill(tensors, shape, seed)
        if cuda is not None:
            torch.cuda.synchronize()
        regions = _region_rows(tensors)
        agent.register(regions, _mem_type(device))
        conn.send((agent.metadata(), regions))
        while True:
            try:
                cmd, *args = conn.recv()
            except EOFError:
                break
            if cmd == "stop":
                conn.send(None)
                break
            try:
                if cmd == "digests":
                    layer, blocks = args
                    conn.send(block_digests(tensors, layer, blocks, shape.block_bytes))
                else:
                    conn.send(ValueError(f"unknown command {cmd!r}"))
            except Exception as exc:
                conn.send(exc)
    except Exception as exc:
        with contextlib.suppress(Exception):
            conn.send(exc)
    finally:
        agent.close()


class NaiveOwner:
    """The owner process: a pool on ``device`` registered with its own NIXL agent."""

    def __init__(self, name: str, shape: PoolShape, device: str, seed: int = 7) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_owner_main, args=(name, shape, device, seed, child), daemon=True
        )
        self.proc.start()
        child.close()
        self.name = name
        self.mem = _mem_type(device)
        if not self._conn.poll(START_TIMEOUT_S):
            self.close()
            raise TimeoutError(f"the owner process did not start in {START_TIMEOUT_S:.0f}s")
        try:
            hello = self._conn.recv()
        except EOFError:
            self.proc.join(10)
            code = self.proc.exitcode
            self.close()
            raise RuntimeError(
                f"the owner process exited (status {code}) before it was ready"
            ) from None
        if isinstance(hello, Exception):
            self.close()
            raise RuntimeError(f"the owner process failed to start: {hello!r}")
        self.metadata: bytes = hello[0]
        self.regions: Int64Array = hello[1]

    def call(self, cmd: str, *args: Any, timeout_s: float = 120.0) -> Any:
        self._conn.send((cmd, *args))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"the owner did not answer {cmd} in {timeout_s:.0f}s")
        out = self._conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.call("stop", timeout_s=10)
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self._conn.close()


@dataclass(frozen=True)
class NaiveResult:
    nbytes: int
    descriptors: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class NaiveReader:
    """This process's side: a pool on ``device``, an agent and a non-coalescing engine."""

    def __init__(self, name: str, shape: PoolShape, device: str, owner: NaiveOwner) -> None:
        from kvxferd.nixl import AgentOptions, NixlAgent
        from kvxferd.transfer import EngineOptions, TransferEngine

        _quiet_nixl()
        self.shape = shape
        self.device = device
        cuda = _cuda_index(device)
        self.tensors = _allocate(shape, device)
        self.agent: NixlAgent = NixlAgent(name, cuda_device=cuda, options=AgentOptions())
        self.agent.start()
        self.engine: TransferEngine | None = None
        try:
            regions = _region_rows(self.tensors)
            self.agent.register(regions, _mem_type(device))
            self.engine = TransferEngine(
                self.agent,
                regions,
                local_mem=_mem_type(device),
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
        posted as one READ by the raw agent and polled in a plain loop (no engine, no daemon)."""
        from kvxferd.nixl import XferOp, XferState
        from kvxferd.transfer.descriptors import RegionTable, build_descriptors

        plan = per_block_plan(
            local, remote, num_layers=self.shape.num_layers, block_bytes=self.shape.block_bytes
        )
        loc, rem = build_descriptors(
            plan,
            RegionTable.from_array(_region_rows(self.tensors)),
            RegionTable.from_array(self.owner.regions),
            merge=True,
        )
        mem = _mem_type(self.device)
        t0 = time.perf_counter()
        h = self.agent.post(
            XferOp.READ, loc, rem, peer=self.owner.name, local_mem=mem, remote_mem=self.owner.mem
        )
        try:
            while self.agent.poll(h) is not XferState.DONE:
                pass
            dt = time.perf_counter() - t0
        finally:
            self.agent.release(h)
        return NaiveResult(int(loc[:, 1].sum()), int(loc.shape[0]), dt)

    def verify(self, local: Int64Array, remote: Int64Array, samples: int, seed: int) -> int:
        """Compare ``samples`` random (layer, block) pairs with the owner; return mismatches."""
        rng = np.random.default_rng(seed)
        bad = 0
        pick = rng.choice(local.size, size=min(samples, local.size), replace=False)
        for layer in sorted(set(int(x) for x in rng.integers(self.shape.num_layers, size=4))):
            mine = block_digests(self.tensors, layer, local[pick], self.shape.block_bytes)
            theirs = self.owner.call("digests", layer, remote[pick])
            bad += sum(1 for a, b in zip(mine, theirs, strict=True) if a != b)
        return bad

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.agent.close()
