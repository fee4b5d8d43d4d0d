"""Attaching an engine's KV pool to the daemon, and detaching it when the engine goes away.

Modes (``Engine.Attach``):

* **OWNED** (the default and the fast path): the daemon allocates the pool itself, so NIXL/UCX
  registers memory the daemon allocated (UCX's cuda_ipc fast path stays available), and
  exports handles the engine maps to compute straight into it: DRAM as POSIX shared memory
  (``/dev/shm/kvxferd-<instance>-g<generation>-<region>``), VRAM as a CUDA IPC handle of the
  daemon's allocation.
* **IMPORTED**: the engine allocates; DRAM arrives as a shared-memory name, VRAM as a CUDA IPC
  handle. The daemon maps it and checks the tensor's shape, strides and dtype against the spec
  (:meth:`KVPool.from_tensors`). IMPORTED DRAM is registered with NIXL like any pool.
  IMPORTED VRAM is **not** (NIXL reads imported CUDA memory at 0.5-0.6 GB/s and once failed to
  register it, docs/attachment.md): it is served by same-host KERNEL pulls only. The daemon
  publishes the engine's own handle and offset per region in the handshake's CUDA IPC export
  (:meth:`kvxferd.ipc.publish.Publisher.forward`; an opened handle cannot be exported again)
  with ``kernel_only_reason`` set, so a reader that cannot use KERNEL refuses the pull at
  StartPull, and pulls into this pool are KERNEL or refused too.

Liveness: after Attach the engine opens ``Engine.Session``. When that stream ends (the engine
process died and its socket closed), or no session is opened within ``pool.session_grace_ms``,
or the engine calls Detach, :meth:`Attacher.detach` runs: the slot stops serving (peers get
UNAVAILABLE saying why), the generation is bumped, held requests are released with reason
ENGINE_DETACHED, local transfers in flight are cancelled, the memory is deregistered from NIXL
(an imported VRAM pool is no longer published), owned shared memory is unlinked and imported
mappings are dropped (unmapped as soon as no tensor uses them: the engine's memory can then be
freed), so a restarted engine can attach again at once. Readers drop their mappings of the old
generation's handles when they see the new generation (or the peer unavailable).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvxferd.daemon.attach_memory import (
    Attachment,
    AttachRequest,
    Built,
    ExportHandle,
    ImportHandle,
    MemoryMode,
    build_memory,
    drop_memory,
    resolve_memory,
)
from kvxferd.daemon.quiesce import release_pool
from kvxferd.daemon.slot import Served
from kvxferd.errors import (
    AlreadyExists,
    EngineDetached,
    KvxferdError,
    LeaseRefused,
    StateConflict,
)
from kvxferd.layout.spec import MemoryType
from kvxferd.logs import kv
from kvxferd.nixl import MemType, NixlAgent, Registration
from kvxferd.peers import PeerInfo
from kvxferd.transfer import ReleaseReason

if TYPE_CHECKING:
    from kvxferd.daemon.core import Daemon

log = logging.getLogger(__name__)

_NO_ROWS = np.zeros((0, 3), dtype=np.int64)


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
        publisher = self.d.staging.ipc.publisher if self.d.staging is not None else None
        async with self._lock:
            memory, spec = resolve_memory(
                req,
                self.device,
                cuda_ipc=publisher is not None and publisher.enabled,
                transfer_mode=self.d.limits.transfer_mode,
            )
            self.d.slot.begin()
            att_id = uuid.uuid4().hex
            mem = MemType.VRAM if memory is MemoryType.VRAM else MemType.DRAM
            built: Built | None = None
            reg: Registration | None = None
            try:
                built = await asyncio.to_thread(
                    build_memory,
                    spec,
                    req,
                    att_id,
                    device=self.device,
                    instance_id=self.d.instance_id,
                )
                rows = built.pool.region_rows()
                if built.kernel_only:  # IMPORTED VRAM: published to KERNEL readers, no NIXL
                    assert publisher is not None
                    publisher.forward(built.pool, built.forwarded)
                else:
                    reg = await asyncio.to_thread(self.agent.register, rows, mem)
                local = self.d.local_rows(rows)
                await asyncio.to_thread(self.d.engine.set_local, local, mem, "pool attached")
                metadata = await asyncio.to_thread(self.agent.metadata)
            except BaseException as exc:
                if publisher is not None and built is not None and built.kernel_only:
                    publisher.forget()
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
                    traceback.clear_frames(exc.__traceback__)  # no frame keeps a pool tensor
                    drop_memory(segments, mappings, memory)
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
                kernel_only=built.kernel_only,
            )
            att.generation = self.d.slot.fill(Served(built.pool, info), metadata)
            self.d.rebind_staging(built.pool)
            self.attachment = att
        log.info(
            "engine attached",
            extra=kv(
                attachment=att_id,
                mode=req.mode.value,
                memory=memory.value,
                generation=att.generation,
                spec=spec.describe(),
                bytes=spec.nbytes,
                kernel_only=att.kernel_only,
            ),
        )
        asyncio.get_running_loop().call_later(self.session_grace_s, self._check_session, att)
        self._changed()
        return att

    # -- sessions -------------------------------------------------------------------------------

    def open_session(self, attachment_id: str) -> Attachment:
        att = self.attachment
        if att is None or att.attachment_id != attachment_id:
            raise StateConflict(
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
                raise StateConflict(
                    f"attachment {attachment_id!r} is not the current one ({att.attachment_id})",
                    field="attachment_id",
                    fix="detach the attachment you made, or leave attachment_id empty",
                )
            held = self.d.owner.held_request_ids()
            if held and not force:
                raise StateConflict(
                    f"{len(held)} requests are held (e.g. {held[:3]}); detaching would free"
                    " blocks readers may still be reading",
                    field="force",
                    fix="wait for their releases, or set force = true to release them all",
                )
            served = self.d.slot.empty(why)  # no pull plans into the pool from here on
            # Every pull into the pool ends before its memory goes (kvxferd/daemon/quiesce.py).
            pulls = await release_pool(self.d.reader, f"the engine detached: {why}")
            if att.kernel_only and self.d.staging is not None:
                self.d.staging.ipc.publisher.forget()  # its handles are published no more
            att.ended.set()
            self.attachment = None
            # A reader that confirmed a share may still be reading (its READ posted, or its
            # daemon stalled): it trusts the blocks until its share expires. The memory stays
            # mapped, unchanged, until then, so the next engine's pool cannot be mapped at
            # those addresses under that READ (a same-host READ reads virtual addresses).
            keep_s = self.d.leases.reading_left(held)
            released = 0
            for rid in held:
                with contextlib.suppress(LeaseRefused):
                    self.d.leases.cancel(rid, ReleaseReason.ENGINE_DETACHED)
                    released += 1
            # Push mode: an owner's WRITE into this pool must be over before the pool goes.
            pushes = await self.d.reader.receiver.settle()
            if pushes:
                log.info("pushes ended before the detach", extra=kv(pushes=pushes))
            mem = MemType.VRAM if att.memory is MemoryType.VRAM else MemType.DRAM
            await asyncio.to_thread(
                self.d.engine.set_local, self.d.local_rows(_NO_ROWS), mem, f"engine detached: {why}"
            )
            old = self.d.rebind_staging(None)
            if old is not None:
                await old.quiesce()  # no STAGED gather reads the pool any more
            del old  # it holds the pool's tensors, which drop_memory below lets go
            if att.registration is not None:
                try:
                    await asyncio.to_thread(self.agent.deregister, att.registration)
                except KvxferdError as err:
                    log.warning("deregister failed", extra=kv(error=str(err)))
            with contextlib.suppress(KvxferdError):
                self.d.slot.set_metadata(await asyncio.to_thread(self.agent.metadata))
            if keep_s > 0:
                self.d.parts.spawn(_keep(served, keep_s))
            del served
            segments, mappings = att.segments, att.mappings
            att.segments, att.mappings = [], []
            await asyncio.to_thread(drop_memory, segments, mappings, att.memory, kept_s=keep_s)
        self.d.metrics.engine_detaches.labels(cause).inc()
        log.warning(
            "engine detached",
            extra=kv(
                attachment=att.attachment_id,
                cause=cause,
                why=why,
                released=released,
                pulls_cancelled=pulls,
                generation=self.d.slot.generation,
            ),
        )
        self._changed()
        return released

    async def close(self) -> None:
        """At shutdown: detach whatever is attached (unlinks owned shared memory)."""
        if self.attachment is not None:
            with contextlib.suppress(KvxferdError):
                await self.detach("the daemon is shutting down", force=True, cause="shutdown")

    def _changed(self) -> None:
        for cb in self._on_change:
            cb()


async def _keep(served: Served, seconds: float) -> None:
    """Hold a detached pool's tensors (its memory stays mapped) for ``seconds``."""
    await asyncio.sleep(seconds)
    del served


__all__ = [
    "AttachRequest",
    "Attacher",
    "Attachment",
    "ExportHandle",
    "ImportHandle",
    "MemoryMode",
]
