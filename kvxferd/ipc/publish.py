"""Owner side: the pool's VRAM regions as CUDA IPC handles, for the handshake payload.

:class:`Publisher` exports every region of a VRAM pool once per (pool, registration
generation) and caches the answer, since a daemon describes itself on every handshake and
heartbeat. Regions that share one CUDA allocation share its handle (each with its own offset);
the reader opens each distinct handle once. An export that fails (PyTorch's
``expandable_segments`` memory, a driver without IPC) is published as ``unavailable`` with the
reason, so a reader says why it reads over NIXL instead.

Engine-attached IMPORTED VRAM (the engine allocated the pool, the daemon mapped it over CUDA IPC)
cannot be exported again: memory opened from an IPC handle has no handle of its own in the
importing process. The attacher hands the engine's own handle and offset of each region to
:meth:`Publisher.forward`, and the pool's export carries those instead (any process on the host
can open them). Such a pool is not registered with NIXL (NIXL reads imported CUDA memory at
~0.5 GB/s, docs/attachment.md), so its export also says it is served by KERNEL only
(:attr:`IpcPool.kernel_only`, ``HandshakePayload.kernel_only_reason``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvxferd.errors import KvxferdError, SpecError
from kvxferd.ipc.host import device_uuid
from kvxferd.layout.spec import MemoryType
from kvxferd.logs import kv
from kvxferd.pool import KVPool
from kvxferd.v1 import peer_pb2

log = logging.getLogger(__name__)

HANDLE_BYTES = 64
KERNEL_ONLY = (
    "its pool is engine-attached IMPORTED GPU memory, which it did not register with NIXL"
    " (NIXL reads imported CUDA memory at 0.5-0.6 GB/s; docs/attachment.md)"
)


@dataclass(frozen=True)
class IpcRegion:
    """One region inside an exported allocation."""

    handle: bytes
    offset: int
    nbytes: int
    device_uuid: str


@dataclass(frozen=True)
class IpcPool:
    """A pool's regions over CUDA IPC, in spec order; ``unavailable`` says why there are none.
    ``kernel_only``: non-empty when the pool is read with KERNEL only, and why (the handshake
    carries it as ``HandshakePayload.kernel_only_reason``, outside ``CudaIpcExport``)."""

    regions: tuple[IpcRegion, ...] = ()
    unavailable: str = ""
    kernel_only: str = ""

    def to_proto(self) -> peer_pb2.CudaIpcExport:
        return peer_pb2.CudaIpcExport(
            regions=[
                peer_pb2.CudaIpcRegion(
                    handle=r.handle, offset=r.offset, nbytes=r.nbytes, device_uuid=r.device_uuid
                )
                for r in self.regions
            ],
            unavailable=self.unavailable,
        )

    @classmethod
    def from_proto(cls, msg: peer_pb2.CudaIpcExport) -> IpcPool:
        """Decode a peer's export; anything malformed becomes ``unavailable`` (the peer is then
        read over NIXL), never an error: KERNEL is an optimisation, not a requirement."""
        if msg.unavailable and not msg.regions:
            return cls((), msg.unavailable)
        if not msg.regions:
            return cls((), "the peer exported no regions")
        out = []
        for i, r in enumerate(msg.regions):
            if len(r.handle) != HANDLE_BYTES or r.nbytes == 0 or not r.device_uuid:
                return cls(
                    (),
                    f"the peer's CUDA IPC region {i} is malformed ({len(r.handle)}-byte handle,"
                    f" {r.nbytes} bytes, device {r.device_uuid!r})",
                )
            if r.offset >= 1 << 62 or r.nbytes >= 1 << 62:
                return cls((), f"the peer's CUDA IPC region {i} has an impossible size")
            out.append(IpcRegion(bytes(r.handle), int(r.offset), int(r.nbytes), r.device_uuid))
        return cls(tuple(out))


Exporter = Callable[[torch.Tensor, int], tuple[bytes, int]]


def _cuda_export(t: torch.Tensor, nbytes: int) -> tuple[bytes, int]:
    from kvxferd.attach.cuda_ipc import export_tensor

    e = export_tensor(t, nbytes)
    return e.handle, e.offset


@dataclass(frozen=True)
class Forwarded:
    """An imported pool and its export: the engine's handle and offset per region (in spec
    order), served by KERNEL only."""

    pool: weakref.ref[KVPool]  # never keeps the pool (and so the engine's memory) mapped
    export: IpcPool


class Publisher:
    """Exports a pool's regions once per (pool, generation); thread-safe."""

    def __init__(
        self,
        *,
        enabled: bool = True,
        exporter: Exporter = _cuda_export,
        uuid_of: Callable[[int], str | None] = device_uuid,
    ) -> None:
        self.enabled = enabled
        self._exporter = exporter
        self._uuid_of = uuid_of
        self._lock = threading.Lock()
        self._key: tuple[int, int] | None = None
        self._value: IpcPool | None = None
        self._forwarded: Forwarded | None = None

    def forward(self, pool: KVPool, handles: Sequence[tuple[bytes, int]]) -> None:
        """Publish ``pool`` (IMPORTED VRAM: memory this process opened from the engine's
        handles) with the engine's own ``(handle, offset)`` per region, in spec order, and as
        served by KERNEL only. Raises :class:`SpecError` when it could not be published (the
        attach is then refused: nobody could read the pool)."""
        if not self.enabled:
            raise SpecError(
                "IMPORTED VRAM is served by KERNEL pulls only, and this daemon's"
                " transfer.cuda_ipc = false",
                field="memory_mode",
                fix="set transfer.cuda_ipc = true on the daemon, or attach with MEMORY_MODE_OWNED",
            )
        if len(handles) != len(pool.memory):
            raise SpecError(f"{len(handles)} handles for {len(pool.memory)} regions")
        regions = []
        for (handle, offset), m in zip(handles, pool.memory, strict=True):
            uuid = self._uuid_of(m.device)
            if uuid is None:
                raise SpecError(
                    f"the UUID of GPU {m.device} is unknown, so readers could not find the"
                    " imported memory",
                    fix="run the daemon with the NVIDIA driver visible, or attach OWNED",
                )
            regions.append(IpcRegion(bytes(handle), int(offset), m.nbytes, uuid))
        with self._lock:
            export = IpcPool(tuple(regions), kernel_only=KERNEL_ONLY)
            self._forwarded = Forwarded(weakref.ref(pool), export)
            self._key = self._value = None

    def forget(self) -> None:
        """The forwarded pool went away (its engine detached): publish nothing for it."""
        with self._lock:
            self._forwarded = None
            self._key = self._value = None

    @property
    def kernel_only(self) -> str:
        """Non-empty while this daemon's pool is forwarded (served by KERNEL only): why."""
        fwd = self._forwarded
        return KERNEL_ONLY if fwd is not None and fwd.pool() is not None else ""

    def export(self, pool: KVPool, generation: int) -> IpcPool | None:
        """The pool's export; None for a DRAM pool (nothing to publish)."""
        if pool.memory_type is not MemoryType.VRAM:
            return None
        fwd = self._forwarded
        if fwd is not None and fwd.pool() is pool:
            return fwd.export
        if not self.enabled:
            return IpcPool((), "its transfer.cuda_ipc = false")
        key = (id(pool), generation)
        with self._lock:
            if self._key == key and self._value is not None:
                return self._value
            value = self._export(pool)
            self._key, self._value = key, value
            return value

    def _export(self, pool: KVPool) -> IpcPool:
        regions = []
        try:
            for r, m in zip(pool.spec.regions, pool.memory, strict=True):
                uuid = self._uuid_of(m.device)
                if uuid is None:
                    return IpcPool((), f"the UUID of GPU {m.device} is unknown (no CUDA driver)")
                handle, offset = self._exporter(pool.tensors[r.name], m.nbytes)
                regions.append(IpcRegion(handle, offset, m.nbytes, uuid))
        except KvxferdError as err:
            log.warning("cuda ipc export failed; peers read over NIXL", extra=kv(error=str(err)))
            return IpcPool((), f"exporting its regions failed: {err}")
        distinct = len({x.handle for x in regions})
        log.info("cuda ipc export", extra=kv(regions=len(regions), allocations=distinct))
        return IpcPool(tuple(regions))
