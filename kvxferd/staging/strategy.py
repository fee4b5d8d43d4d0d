"""DIRECT, STAGED or KERNEL: eligibility and a cost model (pure: numbers and specs in, a choice
out).

* **DIRECT** reads remote blocks straight into local blocks: one NIXL descriptor per coalesced
  run. Its cost is dominated by descriptors when blocks are fragmented:
  ``descriptors x descriptor_s + bytes / link``.
* **STAGED** has the owner gather the blocks into a slot of its staging ring, reads the slot
  with one descriptor, and scatters it locally, chunk by chunk, pipelined:
  ``bytes / min(link, gather, scatter) + chunks x (chunk_s + descriptor_s) + fill``, where
  ``fill`` is the first chunk's gather plus the last chunk's scatter (not overlapped).
* **KERNEL** (peers on one host, VRAM on both sides): the reader maps the owner's regions over
  CUDA IPC and copies every (region, block run) of the pull with SM kernels in one launch
  (:mod:`kvxferd.ipc`): ``launch_s + bytes / kernel``, no per-descriptor cost. ``auto`` picks it
  whenever it is eligible (:func:`kvxferd.ipc.eligibility.kernel_ineligible` says why not).
* **CMA** (peers on one host, DRAM on both sides): the reader copies the pull's ranges out of
  the owner's process with batched ``process_vm_readv`` calls (:mod:`kvxferd.ipc.cma_reader`):
  ``calls x call_s + bytes / cma``, one call per 1024 ranges instead of one UCX operation per
  descriptor. ``auto`` and ``kernel`` pick it whenever it is eligible
  (:func:`kvxferd.ipc.cma_eligibility.cma_ineligible` says why not).

STAGED copies whole blocks, so it is only eligible when both sides advertise a staging ring,
the TP sizes match (no byte slicing), every region pair has the same block length and layout
(no permute), and a block row fits a slot; :func:`staged_ineligible` says why not. ``auto``
picks STAGED only when its estimate is below :data:`STAGED_MARGIN` of DIRECT's: the staged
estimate leans on a measured per-chunk constant whose error would otherwise pick STAGED where
it runs slower than DIRECT (docs/strategies.md).

Default constants per memory type: VRAM from the two-H200 (NVLink) measurements in
docs/nixl.md §5; DRAM measured on the 2-core CPU machine (see docs/strategies.md for how).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvxferd.layout.spec import KVCacheSpec, MemoryType
from kvxferd.staging.chunks import RingInfo


class Strategy(StrEnum):
    DIRECT = "DIRECT"
    STAGED = "STAGED"
    KERNEL = "KERNEL"
    CMA = "CMA"


class Mode(StrEnum):
    """``transfer.strategy``."""

    AUTO = "auto"
    DIRECT = "direct"
    STAGED = "staged"
    KERNEL = "kernel"  # a same-host copy (KERNEL on GPU, CMA on host memory) when possible


# auto picks STAGED only when its estimate is at most this fraction of DIRECT's.
STAGED_MARGIN = 0.9
# KERNEL: the launch, the event wait in a worker thread and the table upload, per pull.
KERNEL_LAUNCH_S = 100e-6
# CMA, measured on the 2-core VM (docs/benchmarks.md, "Host memory: CMA"): one process_vm_readv
# call of up to 1024 iovecs costs ~20 us beyond its bytes, which two threads copy at ~8 GB/s.
CMA_CALL_S = 20e-6
CMA_IOVECS_PER_CALL = 1024
CMA_BPS = 8e9


@dataclass(frozen=True)
class CostModel:
    """Seconds per descriptor and per chunk; bandwidths in bytes per second."""

    descriptor_s: float
    chunk_s: float
    link_bps: float
    gather_bps: float
    scatter_bps: float
    kernel_bps: float = 0.0  # KERNEL copy rate; 0: gather_bps

    @classmethod
    def defaults(cls, memory: MemoryType) -> CostModel:
        if memory is MemoryType.VRAM:
            # docs/nixl.md §5: ~6 us per descriptor through cuda_ipc, 394 GB/s NVLink raw copy,
            # 873 GB/s torch gather of random blocks on one GPU. Chunk cost: measured through the
            # daemons on two H200s (docs/benchmarks.md): a Gather round trip plus the READ's
            # observed completion cost ~5 ms per chunk beyond the copies themselves.
            return cls(6e-6, 5e-3, 394e9, 873e9, 873e9)
        # Measured here (2-core CPU, UCX CMA on loopback); docs/strategies.md says how.
        return cls(DRAM_DESCRIPTOR_S, DRAM_CHUNK_S, DRAM_LINK_BPS, DRAM_GATHER_BPS, DRAM_GATHER_BPS)

    def with_overrides(
        self,
        *,
        descriptor_us: float = 0.0,
        chunk_us: float = 0.0,
        link_gbps: float = 0.0,
        gather_gbps: float = 0.0,
    ) -> CostModel:
        """A copy with every non-zero figure replaced (config keys ``transfer.cost_*``)."""
        return CostModel(
            descriptor_us * 1e-6 if descriptor_us else self.descriptor_s,
            chunk_us * 1e-6 if chunk_us else self.chunk_s,
            link_gbps * 1e9 if link_gbps else self.link_bps,
            gather_gbps * 1e9 if gather_gbps else self.gather_bps,
            gather_gbps * 1e9 if gather_gbps else self.scatter_bps,
        )

    def direct_seconds(self, descriptors: int, nbytes: int) -> float:
        return descriptors * self.descriptor_s + nbytes / self.link_bps

    def kernel_seconds(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        return KERNEL_LAUNCH_S + nbytes / (self.kernel_bps or self.gather_bps)

    def cma_seconds(self, ranges: int, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        calls = -(-max(1, ranges) // CMA_IOVECS_PER_CALL)
        return calls * CMA_CALL_S + nbytes / CMA_BPS

    def staged_seconds(self, nbytes: int, chunks: int) -> float:
        if chunks <= 0 or nbytes <= 0:
            return 0.0
        per_chunk = nbytes / chunks
        fill = per_chunk / self.gather_bps + per_chunk / self.scatter_bps
        slowest = min(self.link_bps, self.gather_bps, self.scatter_bps)
        return nbytes / slowest + chunks * (self.chunk_s + self.descriptor_s) + fill


# DRAM defaults, measured with ``python -m bench.staging_costs`` on the shared 2-core CPU
# machine (docs/strategies.md, "Measured constants"): 1 KiB descriptors ~6.3 us each; 32 MiB
# descriptors 3.5-3.8 GB/s; a daemon's gather of a 2 MiB row ~1.3 ms (~1.6 GB/s; the twin alone
# reached 0.6-8 GB/s depending on load); a Gather round trip beyond the gather ~1.2 ms.
DRAM_DESCRIPTOR_S = 6.3e-6
DRAM_CHUNK_S = 1.2e-3
DRAM_LINK_BPS = 3.6e9
DRAM_GATHER_BPS = 1.6e9


@dataclass(frozen=True)
class Choice:
    """The strategy of one pull, why, and the estimates (NaN where ineligible)."""

    strategy: Strategy
    reason: str
    direct_s: float
    staged_s: float
    kernel_s: float = math.nan
    cma_s: float = math.nan


def choose(
    mode: Mode,
    model: CostModel,
    *,
    descriptors: int,
    nbytes: int,
    chunks: int,
    ineligible: str | None,
    kernel_ineligible: str | None = "not considered",
    cma_ineligible: str | None = "not considered",
) -> Choice:
    """Pick the strategy. ``ineligible``: why STAGED cannot run (None if it can);
    ``kernel_ineligible``: why KERNEL cannot (None if it can); ``cma_ineligible``: why CMA
    cannot (None if it can; "not considered" keeps it out of the reason, as for GPU pools).
    ``auto`` and ``kernel`` take KERNEL, else CMA, whenever it can run; a forced STAGED or
    KERNEL that cannot run falls back (STAGED to DIRECT, KERNEL to what ``auto`` picks between
    DIRECT and STAGED), with the reason. ``direct`` and ``staged`` never pick CMA."""
    direct = model.direct_seconds(descriptors, nbytes)
    if cma_ineligible is None and kernel_ineligible is not None:
        if mode in (Mode.AUTO, Mode.KERNEL):
            cma = model.cma_seconds(descriptors, nbytes)
            how = "forced by transfer.strategy = kernel" if mode is Mode.KERNEL else "auto"
            why = (
                f"{how}: same-host host-memory peer read with process_vm_readv, estimated"
                f" {cma * 1e3:.3f} ms vs {direct * 1e3:.3f} ms direct"
            )
            return Choice(Strategy.CMA, why, direct, math.nan, math.nan, cma)
    elif mode in (Mode.AUTO, Mode.KERNEL) and cma_ineligible not in (None, "not considered"):
        pre = f"CMA not possible: {cma_ineligible}; "
        if mode is Mode.KERNEL:  # host memory: the same-host copy it asked for is CMA
            mode, pre = Mode.AUTO, f"forced kernel, but {pre}as auto: "
        inner = choose(
            mode,
            model,
            descriptors=descriptors,
            nbytes=nbytes,
            chunks=chunks,
            ineligible=ineligible,
            kernel_ineligible="not considered",
        )
        return Choice(inner.strategy, pre + inner.reason, inner.direct_s, inner.staged_s)
    kernel = math.nan if kernel_ineligible is not None else model.kernel_seconds(nbytes)
    if kernel_ineligible is None and mode in (Mode.AUTO, Mode.KERNEL):
        how = "forced by transfer.strategy = kernel" if mode is Mode.KERNEL else "auto"
        why = (
            f"{how}: same-host peer over CUDA IPC, estimated {kernel * 1e3:.3f} ms kernel copy"
            f" vs {direct * 1e3:.3f} ms direct"
        )
        return Choice(Strategy.KERNEL, why, direct, math.nan, kernel)
    prefix = ""
    if mode is Mode.KERNEL:
        prefix = f"forced kernel, but KERNEL not possible: {kernel_ineligible}; as auto: "
        mode = Mode.AUTO
    if ineligible is not None:
        why = f"STAGED not possible: {ineligible}"
        if mode is Mode.STAGED:
            why = f"forced staged, but {why}; fell back to DIRECT"
        return Choice(Strategy.DIRECT, prefix + why, direct, math.nan, kernel)
    staged = model.staged_seconds(nbytes, chunks)
    if mode is Mode.DIRECT:
        return Choice(
            Strategy.DIRECT, "forced by transfer.strategy = direct", direct, staged, kernel
        )
    if mode is Mode.STAGED:
        return Choice(
            Strategy.STAGED, "forced by transfer.strategy = staged", direct, staged, kernel
        )
    if nbytes > 0 and staged < direct * STAGED_MARGIN:
        why = (
            f"estimated {staged * 1e3:.3f} ms staged < {STAGED_MARGIN:g} x"
            f" {direct * 1e3:.3f} ms direct"
        )
        return Choice(Strategy.STAGED, prefix + why, direct, staged, kernel)
    why = (
        f"estimated {direct * 1e3:.3f} ms direct; staged {staged * 1e3:.3f} ms is not below"
        f" {STAGED_MARGIN:g} x direct"
    )
    return Choice(Strategy.DIRECT, prefix + why, direct, staged, kernel)


def group_row_bytes(spec: KVCacheSpec) -> list[int]:
    """Bytes of one staging row per group: one block of every region of the group."""
    rows = [0] * len(spec.groups)
    for r in spec.regions:
        rows[r.group] += r.block_len
    return rows


def staged_ineligible(
    local: KVCacheSpec,
    remote: KVCacheSpec,
    *,
    local_tp_size: int,
    remote_tp_size: int,
    local_ring: RingInfo | None,
    remote_ring: RingInfo | None,
    peer: str,
) -> str | None:
    """Why a pull between these two sides cannot be STAGED, or None when it can."""
    if local_ring is None:
        return "this daemon has no staging ring (transfer.staging_chunks = 0)"
    if remote_ring is None:
        return f"peer {peer} advertises no staging ring (its transfer.staging_chunks = 0)"
    if local_tp_size != remote_tp_size:
        return (
            f"TP sizes differ (local {local_tp_size}, remote {remote_tp_size}): blocks are"
            " sliced by head, staging copies whole blocks"
        )
    if len(local.regions) != len(remote.regions):
        return f"{len(local.regions)} regions here, {len(remote.regions)} on the peer"
    for lr, rr in zip(local.regions, remote.regions, strict=True):
        if (lr.block_len, lr.layout, lr.dtype) != (rr.block_len, rr.layout, rr.dtype):
            return (
                f"region {lr.name!r} differs: {lr.describe()} here, {rr.describe()} on the"
                " peer (staging needs identical block bytes, no permute)"
            )
    slot = min(local_ring.chunk_bytes, remote_ring.chunk_bytes)
    for g, rb in enumerate(group_row_bytes(local)):
        if rb > slot:
            return (
                f"a block row of group {g} is {rb} bytes, more than a staging slot ({slot});"
                " raise transfer.staging_chunk_bytes"
            )
    return None


def whole_blocks_bytes(counts: Sequence[int], row_bytes: Sequence[int]) -> int:
    return sum(n * rb for n, rb in zip(counts, row_bytes, strict=True))
