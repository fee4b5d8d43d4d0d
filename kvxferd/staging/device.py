"""Gather and scatter between the pool and a staging slot.

Calls :func:`kvxferd.kernels.gather_blocks` / :func:`~kvxferd.kernels.scatter_blocks` per KV
group on a slot's sections (:func:`kvxferd.staging.chunks.span_offsets`). On CUDA the work runs
on a side stream. :meth:`PoolCopier.gather` and :meth:`~PoolCopier.scatter` wait for it (callers
run them in a worker thread, :func:`asyncio.to_thread`); on CPU the torch twin runs in that
thread. :meth:`PoolCopier.launch_gather` is for small chunks on the event loop (at most
:data:`INLINE_GATHER_BYTES`): on CPU it copies at once, on CUDA it launches the gather and
returns its event, for the caller to poll between loop turns
(:func:`kvxferd.ipc.completion.wait_event`).
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

# Chunks up to this size are gathered on the event loop (a Stage stream's chunks): on CPU the
# twin gathers 1 KiB in ~45 us and 256 KiB in ~65 us (2-core VM, mostly its per-call checks and
# torch dispatch), work the worker thread does too, after a hop there of ~75 us p50 on that VM;
# on CUDA only the launch runs on the loop. Larger chunks keep the worker thread, so one chunk
# never holds the loop for long.
INLINE_GATHER_BYTES = 256 << 10


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

    def launch_gather(
        self, ids: Sequence[Int64Array], slot: torch.Tensor
    ) -> torch.cuda.Event | None:
        """Start :meth:`gather` without waiting: None when the bytes are already there (CPU),
        else the CUDA event that fires when they are (query it; never free the slot before)."""
        offsets, total = span_offsets([int(a.size) for a in ids], self.row_bytes)
        assert slot.numel() == total, "slot view must be exactly the chunk's bytes"
        if self._stream is None:
            self._copy(ids, slot, offsets, True)
            return None
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            self._copy(ids, slot, offsets, True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._stream)
        return done

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
