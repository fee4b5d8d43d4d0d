"""The memory of an engine attach, and the values that describe it.

**OWNED**: the daemon allocates every region (DRAM as POSIX shared memory the engine maps,
VRAM with a CUDA IPC handle exported to the engine). **IMPORTED**: the engine allocates; the
daemon maps each region and checks its shape, strides and dtype against the spec. What is
built here is registered and served by :class:`~kvxferd.daemon.attach.Attacher`.
"""

from __future__ import annotations

import asyncio
import enum
import gc
import logging
import weakref
from dataclasses import dataclass, field

import torch

from kvxferd.attach import ShmSegment, region_tensor, strided_tensor
from kvxferd.errors import InvalidRequest, SpecError
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import KVCacheSpec, MemoryType
from kvxferd.logs import kv
from kvxferd.nixl import Registration
from kvxferd.pool import KVPool

log = logging.getLogger(__name__)

IMPORTED_VRAM_REFUSED = (
    "IMPORTED VRAM is not supported: GPU memory the engine allocated and shared over CUDA IPC"
    " reads at 0.5-0.6 GB/s once registered with NIXL, against ~300 GB/s for memory the daemon"
    " allocated (docs/attachment.md)"
)


class MemoryMode(enum.Enum):
    OWNED = "OWNED"
    IMPORTED = "IMPORTED"


@dataclass(frozen=True)
class ImportHandle:
    """One region of engine memory (IMPORTED): where it is and what the engine says it is."""

    region: str
    shm_name: str = ""
    cuda_ipc_handle: bytes = b""
    offset: int = 0
    device: int = 0
    shape: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()
    dtype: KVDType | None = None


@dataclass(frozen=True)
class ExportHandle:
    """One region of daemon memory the engine maps (OWNED)."""

    region: str
    offset: int
    nbytes: int
    device: int
    shm_name: str = ""
    cuda_ipc_handle: bytes = b""


@dataclass(frozen=True)
class AttachRequest:
    """``Engine.Attach``, decoded."""

    spec: KVCacheSpec
    mode: MemoryMode
    memory: MemoryType | None = None
    imports: tuple[ImportHandle, ...] = ()
    tp_rank: int = 0
    tp_size: int = 1
    prefix_caching: bool = False


@dataclass
class Attachment:
    """The live attachment (the pool itself is in the daemon's slot)."""

    attachment_id: str
    mode: MemoryMode
    memory: MemoryType
    exports: tuple[ExportHandle, ...]
    generation: int = 0
    registration: Registration | None = None
    segments: list[ShmSegment] = field(default_factory=list)
    mappings: list[weakref.ref[object]] = field(default_factory=list)
    session_open: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class Built:
    pool: KVPool
    exports: tuple[ExportHandle, ...]
    segments: list[ShmSegment]
    mappings: list[weakref.ref[object]]


def resolve_memory(req: AttachRequest, device: str) -> tuple[MemoryType, KVCacheSpec]:
    """The kind of memory the pool lives in, and the spec set to it; refuses what cannot
    attach here (mixed memory, VRAM on a CPU daemon, IMPORTED VRAM, a bad TP rank)."""
    kinds = {r.memory for r in req.spec.regions}
    if req.memory is None and len(kinds) > 1:
        raise SpecError(
            "the spec mixes DRAM and VRAM regions; one pool lives in one kind of memory",
            field="spec.regions",
            fix="give every region the same memory type, or set AttachRequest.memory",
        )
    memory = req.memory or next(iter(kinds))
    if memory is MemoryType.VRAM and not device.startswith("cuda"):
        raise InvalidRequest(
            f"a VRAM pool needs the daemon on a GPU, but pool.device = {device!r}",
            field="memory",
            fix="run the daemon with pool.device = cuda:N (the engine's GPU), or attach DRAM",
        )
    vram_import = req.mode is MemoryMode.IMPORTED and memory is MemoryType.VRAM
    if vram_import:
        raise InvalidRequest(
            IMPORTED_VRAM_REFUSED,
            field="memory_mode",
            fix="attach with MEMORY_MODE_OWNED: the daemon allocates and the engine maps the"
            " daemon's memory over CUDA IPC and computes straight into it (full speed)",
        )
    if not 0 <= req.tp_rank < max(1, req.tp_size):
        raise InvalidRequest(
            f"tp_rank {req.tp_rank} is not in [0, tp_size={req.tp_size})",
            field="tp_rank",
            fix="send 0 <= tp_rank < tp_size",
        )
    return memory, req.spec.with_memory(memory)


def build_memory(
    spec: KVCacheSpec, req: AttachRequest, att_id: str, *, device: str, instance_id: str
) -> Built:
    """Allocate (OWNED) or map (IMPORTED) every region; runs on a worker thread."""
    segments: list[ShmSegment] = []
    mappings: list[weakref.ref[object]] = []
    try:
        if req.mode is MemoryMode.OWNED:
            pool, exports = _build_owned(spec, att_id, segments, device, instance_id)
        else:
            pool = _build_imported(spec, req.imports, segments, mappings, device)
            exports = ()
    except BaseException:
        drop_memory(segments, mappings, spec.regions[0].memory)
        raise
    return Built(pool, exports, segments, mappings)


def _build_owned(
    spec: KVCacheSpec, att_id: str, segments: list[ShmSegment], device: str, instance_id: str
) -> tuple[KVPool, tuple[ExportHandle, ...]]:
    if spec.regions[0].memory is MemoryType.VRAM:
        from kvxferd.attach.cuda_ipc import export_tensor

        pool = KVPool.allocate(spec, device)
        exports = []
        for r in spec.regions:
            ex = export_tensor(pool.tensors[r.name], r.nbytes)
            exports.append(
                ExportHandle(r.name, ex.offset, r.nbytes, ex.device, cuda_ipc_handle=ex.handle)
            )
        return pool, tuple(exports)
    tensors = {}
    exports = []
    prefix = f"kvxferd-{instance_id[:12]}-{att_id[:8]}"
    for i, r in enumerate(spec.regions):
        seg = ShmSegment.create(f"{prefix}-{i}", r.nbytes)
        segments.append(seg)
        tensors[r.name] = region_tensor(r, seg.tensor(0, r.nbytes))
        exports.append(ExportHandle(r.name, 0, r.nbytes, 0, shm_name=seg.name))
    return KVPool(spec, tensors), tuple(exports)


def _build_imported(
    spec: KVCacheSpec,
    imports: tuple[ImportHandle, ...],
    segments: list[ShmSegment],
    mappings: list[weakref.ref[object]],
    device: str,
) -> KVPool:
    names = [r.name for r in spec.regions]
    got = [h.region for h in imports]
    if got != names:
        raise SpecError(
            f"IMPORTED needs one handle per region in spec order {names}, got {got}",
            field="imports",
            fix="send MemoryHandle.region_name for every region, in the spec's order",
        )
    vram = spec.regions[0].memory is MemoryType.VRAM
    tensors: dict[str, torch.Tensor] = {}
    for i, (r, h) in enumerate(zip(spec.regions, imports, strict=True)):
        where = f"imports[{i}] ({r.name})"
        if h.dtype is None or not h.shape:
            raise SpecError(
                f"{where}: the handle carries no tensor shape/strides/dtype to verify",
                field=f"imports[{i}]",
                fix="send MemoryHandle.shape, strides and dtype of the engine's tensor",
            )
        if vram:
            raw = _map_cuda(h, where, r.nbytes, mappings, device)
        else:
            if not h.shm_name:
                raise SpecError(
                    f"{where}: DRAM is imported through POSIX shared memory, but the"
                    " handle names none",
                    field=f"imports[{i}].shm_name",
                    fix="allocate the region in shared memory and send its name",
                )
            seg = ShmSegment.open(h.shm_name)
            segments.append(seg)
            if h.offset + r.nbytes > seg.size:
                raise SpecError(
                    f"{where}: region {r.name!r} needs {r.nbytes} bytes from offset"
                    f" {h.offset}, but shared memory {seg.name} has {seg.size}",
                    field=f"imports[{i}].offset",
                    fix="size the shared memory for the spec (offset + region bytes)",
                )
            raw = seg.tensor(h.offset)
        tensors[r.name] = strided_tensor(raw, h.dtype, h.shape, h.strides, where)
    return KVPool.from_tensors(spec, tensors)


def _map_cuda(
    h: ImportHandle,
    where: str,
    nbytes: int,
    mappings: list[weakref.ref[object]],
    device: str,
) -> torch.Tensor:
    from kvxferd.attach.cuda_ipc import IpcMapping

    if not h.cuda_ipc_handle:
        raise SpecError(
            f"{where}: VRAM is imported through CUDA IPC, but the handle has none",
            fix="send MemoryHandle.cuda_ipc_handle",
        )
    if h.device != int(device.partition(":")[2] or 0):
        raise InvalidRequest(
            f"{where}: the memory is on cuda:{h.device}, the daemon runs on {device}",
            field="imports.device_id",
            fix="run the daemon on the engine's GPU (pool.device) with the same"
            " CUDA_VISIBLE_DEVICES numbering",
        )
    mapping = IpcMapping(h.cuda_ipc_handle, h.device)
    mappings.append(weakref.ref(mapping))
    size = mapping.size or (h.offset + nbytes)
    if h.offset + nbytes > size:
        raise SpecError(
            f"{where}: {nbytes} bytes from offset {h.offset} run past the imported"
            f" allocation of {size} bytes",
            fix="check the handle's offset",
        )
    return mapping.tensor(h.offset, size - h.offset)


def drop_memory(
    segments: list[ShmSegment], mappings: list[weakref.ref[object]], memory: MemoryType
) -> None:
    """Unlink owned shm, drop mappings (unmapped once no tensor uses them)."""
    for seg in segments:
        if seg.created:
            seg.unlink()
        seg.release()
    segments.clear()
    gc.collect()
    alive = sum(1 for w in mappings if w() is not None)
    if alive:
        log.warning("imported CUDA mappings still referenced", extra=kv(mappings=alive))
    if memory is MemoryType.VRAM and torch.cuda.is_available():
        torch.cuda.empty_cache()


__all__ = [
    "IMPORTED_VRAM_REFUSED",
    "AttachRequest",
    "Attachment",
    "Built",
    "ExportHandle",
    "ImportHandle",
    "MemoryMode",
    "build_memory",
    "drop_memory",
    "resolve_memory",
]
