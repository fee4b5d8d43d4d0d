"""The KV pool a daemon serves: the tensors of a spec, their addresses, patterns, checksums.

An *owned* pool is allocated here from a spec (host or GPU memory). Tensors attached by an
engine become a pool through :meth:`KVPool.from_tensors` after their layout is verified
against the spec. The pool knows nothing of NIXL: it hands out ``(addr, len, dev)`` rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvxferd.errors import BlockRangeError, SpecError
from kvxferd.layout.alloc import allocate_pool
from kvxferd.layout.spec import KVCacheSpec, MemoryType
from kvxferd.layout.tensors import spec_from_tensors

DIGEST_SIZE = 8


def gpu_fix(device: str) -> str:
    """What a refusal to allocate a pool on ``device`` adds to its fix ('' for the host)."""
    if not device.startswith("cuda"):
        return ""
    return f", or free memory on {device} (nvidia-smi lists the processes holding it)"


@dataclass(frozen=True)
class RegionMemory:
    """Where one region lives: base address, bytes spanned, device index (0 for DRAM)."""

    addr: int
    nbytes: int
    device: int


class KVPool:
    """A spec plus the tensors that realise it."""

    def __init__(self, spec: KVCacheSpec, tensors: Mapping[str, torch.Tensor]) -> None:
        missing = [r.name for r in spec.regions if r.name not in tensors]
        if missing:
            raise SpecError(f"no tensor for regions {missing}", fix="pass one tensor per region")
        self.spec = spec
        self.tensors = dict(tensors)
        self.memory = tuple(
            RegionMemory(
                addr=int(tensors[r.name].data_ptr()),
                nbytes=r.nbytes,
                device=int(tensors[r.name].device.index or 0),
            )
            for r in spec.regions
        )
        # A byte view (num_blocks, stride) of each region, for patterns and checksums.
        self._rows = [self._byte_rows(r.name, r.num_blocks, r.stride) for r in spec.regions]

    @classmethod
    def allocate(cls, spec: KVCacheSpec, device: str = "cpu") -> KVPool:
        memory = MemoryType.VRAM if device.startswith("cuda") else MemoryType.DRAM
        spec = spec.with_memory(memory)
        return cls(spec, allocate_pool(spec, device))

    @classmethod
    def from_tensors(cls, expected: KVCacheSpec, tensors: Mapping[str, torch.Tensor]) -> KVPool:
        """Verify attached tensors against ``expected`` (shape, dtype, layout) and wrap them."""
        got = spec_from_tensors(
            expected.model,
            expected.groups,
            {r.name: (r.group, tensors[r.name]) for r in expected.regions if r.name in tensors},
            prefer={r.name: r.layout for r in expected.regions},
        )
        exp_regions = {r.name: r for r in expected.regions}
        problems = []
        for r in got.regions:
            e = exp_regions[r.name]
            if (r.shape, r.dtype, r.layout, r.stride) != (e.shape, e.dtype, e.layout, e.stride):
                problems.append(f"{r.name}: expected {e.describe()}, got {r.describe()}")
        if len(got.regions) != len(expected.regions):
            problems.append(
                f"{len(expected.regions) - len(got.regions)} regions of the spec have no tensor"
            )
        if problems:
            raise SpecError(
                "attached tensors do not match the spec: " + "; ".join(problems),
                fix="attach tensors allocated exactly as the spec describes",
            )
        return cls(got, tensors)

    def _byte_rows(self, name: str, num_blocks: int, stride: int) -> torch.Tensor:
        t = self.tensors[name]
        storage = torch.empty(0, dtype=torch.uint8, device=t.device)
        offset = t.storage_offset() * t.element_size()
        return storage.set_(t.untyped_storage(), offset, (num_blocks, stride), (stride, 1))

    def region_rows(self) -> npt.NDArray[np.int64]:
        """N x 3 ``(addr, nbytes, device)`` rows, one per region, for registration."""
        return np.array([(m.addr, m.nbytes, m.device) for m in self.memory], dtype=np.int64)

    @property
    def memory_type(self) -> MemoryType:
        return self.spec.regions[0].memory

    def _check(self, group: int, kernel_ids: Sequence[int]) -> npt.NDArray[np.int64]:
        if not 0 <= group < len(self.spec.groups):
            raise BlockRangeError(
                f"group {group} does not exist; the pool has {len(self.spec.groups)} groups",
                field="group",
            )
        ids = np.asarray(kernel_ids, dtype=np.int64)
        n = self.spec.num_kernel_blocks(group)
        bad = np.flatnonzero((ids < 0) | (ids >= n))
        if bad.size:
            i = int(bad[0])
            raise BlockRangeError(
                f"kernel block ID {int(ids[i])} is outside [0, {n})",
                field=f"block_ids[{i}]",
                fix=f"group {self.spec.groups[group].name!r} has {n} kernel blocks",
            )
        return ids

    def fill_pattern(self, group: int, kernel_ids: Sequence[int], seed: int) -> None:
        """Write a deterministic pattern, distinct per (seed, region, block), into blocks."""
        ids = self._check(group, kernel_ids)
        if ids.size == 0:
            return
        idx = torch.from_numpy(ids).to(self._rows[0].device)
        for ri, r in enumerate(self.spec.regions):
            if r.group != group:
                continue
            rows = self._rows[ri]
            width = r.block_len
            col = torch.arange(width, dtype=torch.int32, device=rows.device)
            base = (idx.to(torch.int32) * 40503 + (seed * 977 + ri * 131)) % 251
            rows[idx, :width] = ((base[:, None] + col[None, :] * 7) % 251).to(torch.uint8)
            # The pattern repeats every 251 blocks; a stamp of (block, region, seed) at the
            # start of each block makes every block of the pool distinct.
            if width >= 16:
                stamp = torch.stack(
                    [idx, torch.full_like(idx, (seed << 20) | ri)], dim=1
                ).contiguous()
                rows[idx, :16] = stamp.view(torch.uint8).view(-1, 16)

    def write_blocks(
        self, region: int, kernel_ids: Sequence[int], data: npt.NDArray[np.uint8]
    ) -> None:
        """Write ``data[i]`` (``block_len`` bytes) into kernel block ``kernel_ids[i]`` of
        region ``region`` (what an engine computing its KV cache does; demos and tests)."""
        r = self.spec.regions[region]
        ids = self._check(r.group, kernel_ids)
        rows = self._rows[region]
        src = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8))
        rows[torch.from_numpy(ids).to(rows.device), : r.block_len] = src.to(rows.device)
        if rows.is_cuda:
            torch.cuda.synchronize(rows.device)  # in place before anyone is told it is

    def checksums(self, group: int, kernel_ids: Sequence[int]) -> list[bytes]:
        """Per kernel block, a digest of that block's bytes in every region of the group."""
        ids = self._check(group, kernel_ids)
        regions = [ri for ri, r in enumerate(self.spec.regions) if r.group == group]
        hashers = [hashlib.blake2b(digest_size=DIGEST_SIZE) for _ in range(ids.size)]
        for ri in regions:
            width = self.spec.regions[ri].block_len
            rows = self._rows[ri]
            picked = rows[torch.from_numpy(ids).to(rows.device), :width].cpu().numpy()
            for h, row in zip(hashers, picked, strict=True):
                h.update(row.tobytes())
        return [h.digest() for h in hashers]
