"""Gather and scatter between the pool and a staging slot, off the event loop.

Calls :func:`kvxferd.kernels.gather_blocks` / :func:`~kvxferd.kernels.scatter_blocks` per KV
group on a slot's sections (:func:`kvxferd.staging.chunks.span_offsets`). On CUDA the work runs
on a side stream and the calling worker thread waits on an event (callers use
:func:`asyncio.to_thread`); on CPU the torch twin runs in that thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvxferd.kernels import gather_blocks, scatter_blocks
from kvxferd.pool import KVPool
from kvxferd.staging.chunks import span_offsets
from kvxferd.staging.strategy import group_row_bytes

Int64Array = npt.NDArray[np.int64]


def _block_rows(
    pool: KVPool, name: str, num_blocks: int, stride: int, block_len: int
) -> torch.Tensor:
    t = pool.tensors[name]
    storage = torch.empty(0, dtype=torch.uint8, device=t.device)
    offset = t.storage_offset() * t.element_size()
    return storage.set_(t.untyped_storage(), offset, (num_blocks, block_len), (stride, 1))


class PoolCopier:
    """Per-group ``(num_blocks, block_len)`` views of a pool, and gather/scatter into slots."""

    def __init__(self, pool: KVPool) -> None:
        spec = pool.spec
        self.row_bytes = group_row_bytes(spec)
        self.views: list[list[torch.Tensor]] = [[] for _ in spec.groups]
        for r in spec.regions:
            self.views[r.group].append(
                _block_rows(pool, r.name, r.num_blocks, r.stride, r.block_len)
            )
        dev = next(iter(pool.tensors.values())).device
        self.device = dev
        self._stream: torch.cuda.Stream | None = None
        if dev.type == "cuda":
            self._stream = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]

    def gather(self, ids: Sequence[Int64Array], slot: torch.Tensor) -> float:
        """Rows of ``ids[g]`` for every group into ``slot`` (exactly their bytes); seconds."""
        return self._run(ids, slot, gather=True)

    def scatter(self, ids: Sequence[Int64Array], slot: torch.Tensor) -> float:
        """The reverse: ``slot``'s rows into blocks ``ids[g]``; seconds."""
        return self._run(ids, slot, gather=False)

    def _run(self, ids: Sequence[Int64Array], slot: torch.Tensor, *, gather: bool) -> float:
        t0 = time.perf_counter()
        offsets, total = span_offsets([int(a.size) for a in ids], self.row_bytes)
        assert slot.numel() == total, "slot view must be exactly the chunk's bytes"
        if self._stream is None:
            self._copy(ids, slot, offsets, gather)
        else:
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                self._copy(ids, slot, offsets, gather)
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(self._stream)
            done.synchronize()
        return time.perf_counter() - t0

    def _copy(
        self, ids: Sequence[Int64Array], slot: torch.Tensor, offsets: list[int], gather: bool
    ) -> None:
        for g, a in enumerate(ids):
            if a.size == 0:
                continue
            part = slot[offsets[g] : offsets[g] + int(a.size) * self.row_bytes[g]]
            if gather:
                gather_blocks(self.views[g], a, part)
            else:
                scatter_blocks(self.views[g], a, part)
