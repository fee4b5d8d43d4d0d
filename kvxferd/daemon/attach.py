"""Attaching an engine's KV pool to the daemon, and detaching it when the engine goes away.

Modes (``Engine.Attach``):

* **OWNED** (the default and the fast path): the daemon allocates the pool itself, so NIXL/UCX
  registers memory the daemon allocated (UCX's cuda_ipc fast path stays available), and
  exports handles the engine maps to compute straight into it: DRAM as POSIX shared memory
  (``/dev/shm/kvxferd-<instance>-g<generation>-<region>``), VRAM as a CUDA IPC handle of the
  daemon's allocation.
* **IMPORTED**: the engine allocates; DRAM arrives as a shared-memory name, VRAM as a CUDA IPC
  handle. The daemon maps it, checks the tensor's shape, strides and dtype against the spec
  (:meth:`KVPool.from_tensors`) and registers it. IMPORTED VRAM is refused: imported CUDA
  memory registered with NIXL reads at 0.5-0.6 GB/s (docs/attachment.md), and registering
  memory imported through the driver API failed outright on the test machine.

Liveness: after Attach the engine opens ``Engine.Session``. When that stream ends (the engine
process died and its socket closed), or no session is opened within ``pool.session_grace_ms``,
or the engine calls Detach, :meth:`Attacher.detach` runs: the slot stops serving (peers get
UNAVAILABLE saying why), the generation is bumped, held requests are released with reason
ENGINE_DETACHED, local transfers in flight are cancelled, the memory is deregistered from NIXL,
owned shared memory is unlinked and imported mappings are dropped (unmapped as soon as no
tensor uses them), so a restarted engine can attach again at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import logging
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvxferd.attach import ShmSegment, region_tensor, strided_tensor
from kvxferd.daemon.slot import Served
from kvxferd.errors import (
    AlreadyExists,
    EngineDetached,
    InvalidRequest,
    KvxferdError,
    LeaseRefused,
    SpecError,
)
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import KVCacheSpec, MemoryType
from kvxferd.logs import kv
from kvxferd.nixl import MemType, NixlAgent, Registration
from kvxferd.peers import PeerInfo
from kvxferd.pool import KVPool
from kvxferd.transfer import ReleaseReason

if TYPE_CHECKING:
    from kvxferd.daemon.core import Daemon

log = logging.getLogger(__name__)

_NO_ROWS = np.zeros((0, 3), dtype=np.int64)

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
class _Built:
    pool: KVPool
    exports: tuple[ExportHandle, ...]
    segments: list[ShmSegment]
    mappings: list[weakref.ref[object]]


class Attacher:
    """Attach and detach engine pools for one daemon (see the module docstring)."""

    def __init__(
        self,
        daemon: Daemon,
        agent: NixlAgent,
        *,
        device: str,
        session_grace_s: float,
    ) -> None:
        self.d = daemon
        self.agent = agent
        self.device = device
        self.session_grace_s = session_grace_s
        self.attachment: Attachment | None = None
        self._lock = asyncio.Lock()
        self._on_change: list[Callable[[], None]] = []

    def on_change(self, callback: Callable[[], None]) -> None:
        self._on_change.append(callback)

    # -- attach ---------------------------------------------------------------------------------

    async def attach(self, req: AttachRequest) -> Attachment:
        if self.attachment is not None or self._lock.locked():
            cur = self.attachment.attachment_id if self.attachment else "(in progress)"
            raise AlreadyExists(
                f"an engine is already attached (attachment {cur}); one daemon serves one pool",
                field="memory_mode",
                fix="Detach first (or let the old engine's session end), then Attach again",
            )
        async with self._lock:
            memory, spec = self._resolve(req)
            self.d.slot.begin()
            att_id = uuid.uuid4().hex
            mem = MemType.VRAM if memory is MemoryType.VRAM else MemType.DRAM
            built: _Built | None = None
            reg: Registration | None = None
            try:
                built = await asyncio.to_thread(self._build, spec, req, att_id)
                rows = built.pool.region_rows()
                reg = await asyncio.to_thread(self.agent.register, rows, mem)
                local = self.d.local_rows(rows)
                await asyncio.to_thread(self.d.engine.set_local, local, mem, "pool attached")
                metadata = await asyncio.to_thread(self.agent.metadata)
            except BaseException as exc:
                if reg is not None:
                    with contextlib.suppress(KvxferdError):
                        await asyncio.to_thread(self.agent.deregister, reg)
                with contextlib.suppress(KvxferdError):
                    await asyncio.to_thread(
                        self.d.engine.set_local, self.d.local_rows(_NO_ROWS), mem, "attach failed"
                    )
                if built is not None:
                    segments, mappings = built.segments, built.mappings
                    built = None
                    self._drop(segments, mappings, memory)
                self.d.slot.abort(f"the last Attach failed ({exc})")
                raise
            info = PeerInfo(
                spec=built.pool.spec,
                tp_rank=req.tp_rank,
                tp_size=req.tp_size,
                prefix_caching=req.prefix_caching,
            )
            att = Attachment(
                att_id,
                req.mode,
                memory,
                built.exports,
                registration=reg,
                segments=built.segments,
                mappings=built.mappings,
            )
            att.generation = self.d.slot.fill(Served(built.pool, info), metadata)
            self.d.rebind_staging(built.pool)
            self.attachment = att
        m = self.d.metrics
        m.registered_bytes.set(int(rows[:, 1].sum()))
        m.pool_generation.set(att.generation)
        log.info(
            "engine attached",
            extra=kv(
                attachment=att_id,
                mode=req.mode.value,
                memory=memory.value,
                generation=att.generation,
                spec=spec.describe(),
                bytes=spec.nbytes,
            ),
        )
        asyncio.get_running_loop().call_later(self.session_grace_s, self._check_session, att)
        self._changed()
        return att

    def _resolve(self, req: AttachRequest) -> tuple[MemoryType, KVCacheSpec]:
        kinds = {r.memory for r in req.spec.regions}
        if req.memory is None and len(kinds) > 1:
            raise SpecError(
                "the spec mixes DRAM and VRAM regions; one pool lives in one kind of memory",
                field="spec.regions",
                fix="give every region the same memory type, or set AttachRequest.memory",
            )
        memory = req.memory or next(iter(kinds))
        if memory is MemoryType.VRAM and not self.device.startswith("cuda"):
            raise InvalidRequest(
                f"a VRAM pool needs the daemon on a GPU, but pool.device = {self.device!r}",
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

    def _gpu(self) -> int:
        return int(self.device.partition(":")[2] or 0)

    def _build(self, spec: KVCacheSpec, req: AttachRequest, att_id: str) -> _Built:
        """Allocate (OWNED) or map (IMPORTED) every region; runs on a worker thread."""
        segments: list[ShmSegment] = []
        mappings: list[weakref.ref[object]] = []
        try:
            if req.mode is MemoryMode.OWNED:
                pool, exports = self._build_owned(spec, att_id, segments)
            else:
                pool = self._build_imported(spec, req.imports, segments, mappings)
                exports = ()
        except BaseException:
            self._drop(segments, mappings, spec.regions[0].memory)
            raise
        return _Built(pool, exports, segments, mappings)

    def _build_owned(
        self, spec: KVCacheSpec, att_id: str, segments: list[ShmSegment]
    ) -> tuple[KVPool, tuple[ExportHandle, ...]]:
        if spec.regions[0].memory is MemoryType.VRAM:
            from kvxferd.attach.cuda_ipc import export_tensor

            pool = KVPool.allocate(spec, self.device)
            exports = []
            for r in spec.regions:
                ex = export_tensor(pool.tensors[r.name], r.nbytes)
                exports.append(
                    ExportHandle(r.name, ex.offset, r.nbytes, ex.device, cuda_ipc_handle=ex.handle)
                )
            return pool, tuple(exports)
        tensors = {}
        exports = []
        prefix = f"kvxferd-{self.d.instance_id[:12]}-{att_id[:8]}"
        for i, r in enumerate(spec.regions):
            seg = ShmSegment.create(f"{prefix}-{i}", r.nbytes)
            segments.append(seg)
            tensors[r.name] = region_tensor(r, seg.tensor(0, r.nbytes))
            exports.append(ExportHandle(r.name, 0, r.nbytes, 0, shm_name=seg.name))
        return KVPool(spec, tensors), tuple(exports)

    def _build_imported(
        self,
        spec: KVCacheSpec,
        imports: tuple[ImportHandle, ...],
        segments: list[ShmSegment],
        mappings: list[weakref.ref[object]],
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
                raw = self._map_cuda(h, where, r.nbytes, mappings)
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
        self, h: ImportHandle, where: str, nbytes: int, mappings: list[weakref.ref[object]]
    ) -> torch.Tensor:
        from kvxferd.attach.cuda_ipc import IpcMapping

        if not h.cuda_ipc_handle:
            raise SpecError(
                f"{where}: VRAM is imported through CUDA IPC, but the handle has none",
                fix="send MemoryHandle.cuda_ipc_handle",
            )
        if h.device != self._gpu():
            raise InvalidRequest(
                f"{where}: the memory is on cuda:{h.device}, the daemon runs on {self.device}",
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

    # -- sessions -------------------------------------------------------------------------------

    def open_session(self, attachment_id: str) -> Attachment:
        att = self.attachment
        if att is None or att.attachment_id != attachment_id:
            raise InvalidRequest(
                f"attachment {attachment_id!r} is not the current one"
                f" ({att.attachment_id if att else 'none attached'})",
                field="attachment_id",
                fix="open the session with the attachment_id of the Attach you just made",
            )
        if att.session_open:
            raise AlreadyExists(
                f"attachment {attachment_id} already has its session open",
                field="attachment_id",
                fix="open one Session per Attach",
            )
        att.session_open = True
        return att

    def session_ended(self, att: Attachment) -> None:
        """The engine's session stream ended: detach unless it already was."""
        if self.attachment is att and not att.ended.is_set():
            self.d.parts.spawn(
                self._detach_quietly(
                    att, "the engine's session ended (the engine process exited or died)", "session"
                )
            )

    def _check_session(self, att: Attachment) -> None:
        if self.attachment is att and not att.session_open and not att.ended.is_set():
            why = f"the engine opened no Session within {self.session_grace_s:g}s of Attach"
            self.d.parts.spawn(self._detach_quietly(att, why, "no_session"))

    async def _detach_quietly(self, att: Attachment, why: str, cause: str) -> None:
        try:
            await self.detach(why, attachment_id=att.attachment_id, force=True, cause=cause)
        except KvxferdError as err:
            log.info("detach skipped", extra=kv(attachment=att.attachment_id, error=str(err)))

    # -- detach ---------------------------------------------------------------------------------

    async def detach(
        self, why: str, *, attachment_id: str = "", force: bool = True, cause: str = "detach"
    ) -> int:
        """Stop serving the attached pool; returns how many held requests were released."""
        async with self._lock:
            att = self.attachment
            if att is None:
                raise EngineDetached(
                    "nothing is attached to detach", fix="Attach first (Describe shows the state)"
                )
            if attachment_id and attachment_id != att.attachment_id:
                raise InvalidRequest(
                    f"attachment {attachment_id!r} is not the current one ({att.attachment_id})",
                    field="attachment_id",
                    fix="detach the attachment you made, or leave attachment_id empty",
                )
            held = self.d.owner.held_request_ids()
            if held and not force:
                raise InvalidRequest(
                    f"{len(held)} requests are held (e.g. {held[:3]}); detaching would free"
                    " blocks readers may still be reading",
                    field="force",
                    fix="wait for their releases, or set force = true to release them all",
                )
            served = self.d.slot.empty(why)
            att.ended.set()
            self.attachment = None
            released = 0
            for rid in held:
                with contextlib.suppress(LeaseRefused):
                    self.d.leases.cancel(rid, ReleaseReason.ENGINE_DETACHED)
                    released += 1
            mem = MemType.VRAM if att.memory is MemoryType.VRAM else MemType.DRAM
            await asyncio.to_thread(
                self.d.engine.set_local, self.d.local_rows(_NO_ROWS), mem, f"engine detached: {why}"
            )
            self.d.rebind_staging(None)
            if att.registration is not None:
                try:
                    await asyncio.to_thread(self.agent.deregister, att.registration)
                except KvxferdError as err:
                    log.warning("deregister failed", extra=kv(error=str(err)))
            with contextlib.suppress(KvxferdError):
                self.d.slot.set_metadata(await asyncio.to_thread(self.agent.metadata))
            del served
            segments, mappings = att.segments, att.mappings
            att.segments, att.mappings = [], []
            await asyncio.to_thread(self._drop, segments, mappings, att.memory)
        m = self.d.metrics
        m.registered_bytes.set(0)
        m.pool_generation.set(self.d.slot.generation)
        m.engine_detaches.labels(cause).inc()
        log.warning(
            "engine detached",
            extra=kv(
                attachment=att.attachment_id,
                cause=cause,
                why=why,
                released=released,
                generation=self.d.slot.generation,
            ),
        )
        self._changed()
        return released

    def _drop(
        self, segments: list[ShmSegment], mappings: list[weakref.ref[object]], memory: MemoryType
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

    async def close(self) -> None:
        """At shutdown: detach whatever is attached (unlinks owned shared memory)."""
        if self.attachment is not None:
            with contextlib.suppress(KvxferdError):
                await self.detach("the daemon is shutting down", force=True, cause="shutdown")

    def _changed(self) -> None:
        for cb in self._on_change:
            cb()
