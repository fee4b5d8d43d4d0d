"""The memory of an engine attach, and the values that describe it.

**OWNED**: the daemon allocates every region (DRAM as POSIX shared memory the engine maps,
VRAM with a CUDA IPC handle exported to the engine). **IMPORTED**: the engine allocates; the
daemon maps each region and checks its shape, strides and dtype against the spec. What is
built here is registered and served by :class:`~kvxferd.daemon.attach.Attacher`.

IMPORTED VRAM is served by KERNEL pulls only (docs/attachment.md): NIXL reads GPU memory
imported over CUDA IPC at 0.5-0.6 GB/s and once failed to register it at all, while an SM
kernel reads it at full speed. So it is never registered with NIXL; :class:`Built` keeps the
engine's own handle and offset per region (``forwarded``), which the daemon publishes to
same-host readers in place of an export of its own (an opened handle cannot be exported
again). :func:`resolve_memory` refuses it where KERNEL cannot serve it: a daemon without a GPU,
with ``transfer.cuda_ipc = false``, or in push mode (the owner WRITEs with NIXL).
"""

from __future__ import annotations

import asyncio
import enum
import gc
import logging
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvxferd.attach import ShmSegment, region_tensor, strided_tensor
from kvxferd.attach.shm import check_shm_room
from kvxferd.errors import InvalidRequest, ResourceExhausted, SpecError
from kvxferd.ipc.host import device_uuid
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import KVCacheSpec, MemoryType
from kvxferd.logs import kv
from kvxferd.nixl import Registration
from kvxferd.pool import KVPool, gpu_fix

if TYPE_CHECKING:
    from kvxferd.attach.cuda_ipc import IpcMapping

log = logging.getLogger(__name__)


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
    device: int = 0  # the engine's CUDA ordinal: shown to the operator (see device_uuid)
    shape: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()
    dtype: KVDType | None = None
    device_uuid: str = ""  # the GPU's UUID; "" from an engine that predates it


@dataclass(frozen=True)
class ExportHandle:
    """One region of daemon memory the engine maps (OWNED)."""

    region: str
    offset: int
    nbytes: int
    device: int
    shm_name: str = ""
    cuda_ipc_handle: bytes = b""
    device_uuid: str = ""  # the GPU's UUID (VRAM): the engine finds the GPU by it


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
    kernel_only: bool = False  # IMPORTED VRAM: published to KERNEL readers, not in NIXL
    session_open: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class Built:
    pool: KVPool
    exports: tuple[ExportHandle, ...]
    segments: list[ShmSegment]
    mappings: list[weakref.ref[object]]
    # IMPORTED VRAM: the engine's (CUDA IPC handle, offset) per region, in spec order, for
    # same-host readers (KERNEL); empty otherwise.
    forwarded: tuple[tuple[bytes, int], ...] = ()

    @property
    def kernel_only(self) -> bool:
        """Served by KERNEL only: not registered with NIXL."""
        return bool(self.forwarded)


def resolve_memory(
    req: AttachRequest, device: str, *, cuda_ipc: bool = True, transfer_mode: str = "pull"
) -> tuple[MemoryType, KVCacheSpec]:
    """The kind of memory the pool lives in, and the spec set to it; refuses what cannot
    attach here (mixed memory, VRAM on a CPU daemon, IMPORTED VRAM where KERNEL cannot serve
    it: ``cuda_ipc`` off or push mode, a bad TP rank)."""
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
    if req.mode is MemoryMode.IMPORTED and memory is MemoryType.VRAM:
        why = ""
        if not cuda_ipc:
            why = "this daemon's transfer.cuda_ipc = false"
        elif transfer_mode == "push":
            why = "this daemon is in push mode (transfer.mode = push: NIXL WRITEs)"
        if why:
            raise InvalidRequest(
                f"IMPORTED VRAM is served by same-host KERNEL pulls only (NIXL reads GPU memory"
                f" imported over CUDA IPC at 0.5-0.6 GB/s, docs/attachment.md), but {why}",
                field="memory_mode",
                fix="attach with MEMORY_MODE_OWNED (the daemon allocates, the engine maps it"
                " over CUDA IPC and computes straight into it: full speed over NIXL too), or"
                " run the daemon with transfer.cuda_ipc = true and transfer.mode = pull",
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
    forwarded: tuple[tuple[bytes, int], ...] = ()
    try:
        if req.mode is MemoryMode.OWNED:
            pool, exports = _build_owned(spec, att_id, segments, device, instance_id)
        else:
            pool = _build_imported(spec, req.imports, segments, mappings, device)
            exports = ()
            if pool.memory_type is MemoryType.VRAM:
                forwarded = tuple((h.cuda_ipc_handle, h.offset) for h in req.imports)
    except BaseException as exc:
        # The tensors made so far live on in the failed frames' locals, which the exception's
        # traceback keeps for as long as anything holds the exception: each keeps its mapping,
        # and so an open descriptor. Clear those frames so that the mappings go now.
        traceback.clear_frames(exc.__traceback__)
        drop_memory(segments, mappings, spec.regions[0].memory)
        raise
    return Built(pool, exports, segments, mappings, forwarded)


def _build_owned(
    spec: KVCacheSpec, att_id: str, segments: list[ShmSegment], device: str, instance_id: str
) -> tuple[KVPool, tuple[ExportHandle, ...]]:
    if spec.regions[0].memory is MemoryType.VRAM:
        from kvxferd.attach.cuda_ipc import export_tensor

        try:
            pool = KVPool.allocate(spec, device)
        except RuntimeError as exc:  # torch.OutOfMemoryError is one
            said = str(exc).strip().partition("\n")[0][:200]
            if "out of memory" not in said.lower():
                raise
            raise ResourceExhausted(
                f"the pool needs {spec.nbytes} bytes on {device}, which cannot allocate them"
                f" ({said})",
                fix=f"attach fewer blocks (num_blocks) or a smaller preset{gpu_fix(device)}",
            ) from exc
        exports = []
        for r in spec.regions:
            ex = export_tensor(pool.tensors[r.name], r.nbytes)
            exports.append(
                ExportHandle(
                    r.name,
                    ex.offset,
                    r.nbytes,
                    ex.device,
                    cuda_ipc_handle=ex.handle,
                    device_uuid=device_uuid(ex.device) or "",
                )
            )
        return pool, tuple(exports)
    check_shm_room(spec.nbytes)
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
    opened: dict[bytes, IpcMapping] = {}  # regions in one engine allocation share its mapping
    for i, (r, h) in enumerate(zip(spec.regions, imports, strict=True)):
        where = f"imports[{i}] ({r.name})"
        if h.dtype is None or not h.shape:
            raise SpecError(
                f"{where}: the handle carries no tensor shape/strides/dtype to verify",
                field=f"imports[{i}]",
                fix="send MemoryHandle.shape, strides and dtype of the engine's tensor",
            )
        if vram:
            raw = _map_cuda(h, where, r.nbytes, opened=opened, mappings=mappings, device=device)
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
    *,
    opened: dict[bytes, IpcMapping],
    mappings: list[weakref.ref[object]],
    device: str,
) -> torch.Tensor:
    """The region's bytes in the engine's allocation, opened once per distinct handle."""
    from kvxferd.attach.cuda_ipc import IpcMapping

    if not h.cuda_ipc_handle:
        raise SpecError(
            f"{where}: VRAM is imported through CUDA IPC, but the handle has none",
            fix="send MemoryHandle.cuda_ipc_handle",
        )
    ordinal = import_ordinal(h, device, where)
    mapping = opened.get(h.cuda_ipc_handle)
    if mapping is None:
        mapping = opened[h.cuda_ipc_handle] = IpcMapping(h.cuda_ipc_handle, ordinal)
        mappings.append(weakref.ref(mapping))
    size = mapping.size or (h.offset + nbytes)
    if h.offset + nbytes > size:
        raise SpecError(
            f"{where}: {nbytes} bytes from offset {h.offset} run past the imported"
            f" allocation of {size} bytes",
            fix="check the handle's offset",
        )
    return mapping.tensor(h.offset, size - h.offset)


def import_ordinal(
    h: ImportHandle, device: str, where: str, uuid_of: Callable[[int], str | None] = device_uuid
) -> int:
    """This daemon's ordinal of ``pool.device`` (``device``), once it is the GPU the engine's
    memory is on. GPUs are compared by UUID (``uuid_of``: this process's UUID of an ordinal),
    since two processes with different CUDA_VISIBLE_DEVICES number the same GPU differently;
    an engine that sends no UUID (older), or a driver that reports none, falls back to
    comparing ordinals, which holds only when both number the GPUs alike."""
    mine = int(device.partition(":")[2] or 0)
    here = uuid_of(mine) if h.device_uuid else None
    if here is not None:
        if here.lower() != h.device_uuid.lower():
            raise InvalidRequest(
                f"{where}: the memory is on GPU {h.device_uuid} (the engine's cuda:{h.device}),"
                f" the daemon runs on {device}, which is GPU {here}",
                field="imports.device_uuid",
                fix="set the daemon's pool.device to the engine's GPU as the daemon numbers it"
                " (CUDA_VISIBLE_DEVICES may number GPUs differently in the two processes;"
                " nvidia-smi -L lists each GPU's UUID)",
            )
        return mine
    if h.device != mine:
        raise InvalidRequest(
            f"{where}: the memory is on cuda:{h.device}, the daemon runs on {device}",
            field="imports.device_id",
            fix="run the daemon on the engine's GPU (pool.device) with the same"
            " CUDA_VISIBLE_DEVICES numbering, or update the engine's kvxferd so that it"
            " sends the GPU's UUID (MemoryHandle.device_uuid)",
        )
    return mine


def drop_memory(
    segments: list[ShmSegment],
    mappings: list[weakref.ref[object]],
    memory: MemoryType,
    *,
    kept_s: float = 0.0,
) -> None:
    """Unlink owned shm, drop mappings (unmapped once no tensor uses them). ``kept_s``: how
    long the detach keeps the pool's tensors for readers still reading (so still mapped)."""
    for seg in segments:
        if seg.created:
            seg.unlink()
        seg.release()
    segments.clear()
    gc.collect()
    alive = sum(1 for w in mappings if w() is not None)
    if kept_s > 0:
        log.info("detached memory kept for readers", extra=kv(seconds=round(kept_s, 3)))
    elif alive:
        log.warning("imported CUDA mappings still referenced", extra=kv(mappings=alive))
    if memory is MemoryType.VRAM and torch.cuda.is_available():
        torch.cuda.empty_cache()


__all__ = [
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
