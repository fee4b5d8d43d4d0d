"""CUDA IPC for VRAM regions, through the CUDA driver API (``libcuda.so.1``, via ctypes).

Export: the base of the allocation holding a tensor (``cuMemGetAddressRange``) gets a
``cuIpcGetMemHandle`` handle; the region starts ``offset`` bytes into it. Import:
``cuIpcOpenMemHandle`` maps the allocation, and :meth:`IpcMapping.tensor` wraps the mapped
bytes as a torch tensor through ``__cuda_array_interface__`` (no copy). The handle is closed
(``cuIpcCloseMemHandle``) only when the last tensor over it is gone, so nothing reads memory
that was unmapped under it.

PyTorch's own ``_share_cuda_`` is not used: it ties the exporter's memory to a reference
counter the importer must decrement, so an importer that dies (an engine killed with SIGKILL)
would pin the exporter's allocation for good.

Known limits (checked and reported): memory from PyTorch's ``expandable_segments`` allocator
cannot be exported (``cuIpcGetMemHandle`` refuses it; NIXL issue 1754); the two processes must
share an IPC namespace and see the same GPU; a process cannot import its own handle.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from kvxferd.errors import InvalidRequest, SpecError
from kvxferd.logs import kv

log = logging.getLogger(__name__)

IPC_HANDLE_SIZE = 64
_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_SIZE)]


class _Driver:
    """The few driver entry points kvxferd needs; loaded once, on first use."""

    _lock = threading.Lock()  # guards _instance and _contexts
    _instance: _Driver | None = None

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise SpecError(
                f"cannot load the CUDA driver (libcuda.so.1): {exc}",
                fix="run on a machine with an NVIDIA driver, or attach DRAM (shared memory)",
            ) from exc
        self.lib = lib
        self.open = _sym(lib, "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle")
        self.range = _sym(lib, "cuMemGetAddressRange_v2", "cuMemGetAddressRange")
        self.push = _sym(lib, "cuCtxPushCurrent_v2", "cuCtxPushCurrent")
        self.pop = _sym(lib, "cuCtxPopCurrent_v2", "cuCtxPopCurrent")
        self.open.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
        self.range.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64,
        ]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]
        lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        self.push.argtypes = [ctypes.c_void_p]
        self.pop.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self.check(lib.cuInit(0), "cuInit")

    @classmethod
    def get(cls) -> _Driver:
        with cls._lock:
            if cls._instance is None:
                cls._instance = _Driver()
            return cls._instance

    def check(self, rc: int, call: str) -> None:
        if rc == 0:
            return
        name = ctypes.c_char_p()
        self.lib.cuGetErrorName(rc, ctypes.byref(name))
        text = name.value.decode() if name.value else f"CUresult {rc}"
        raise SpecError(
            f"{call} failed: {text}",
            fix=_FIXES.get(
                text,
                "check that both processes see the same GPU and share an IPC"
                " namespace (same pod, or hostIPC)",
            ),
        )

    @contextmanager
    def context(self, device: int) -> Iterator[None]:
        """The device's primary context (the one torch uses) current on this thread.

        The primary context is retained once per device and never released: releasing the
        last reference would destroy it, and with it every IPC mapping made in it."""
        with self._lock:
            ctx = self._contexts.get(device)
            if ctx is None:
                dev = ctypes.c_int()
                self.check(self.lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
                ctx = ctypes.c_void_p()
                self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
                self._contexts[device] = ctx
        self.check(self.push(ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self.pop(ctypes.byref(ctypes.c_void_p()))


_FIXES = {
    "CUDA_ERROR_INVALID_VALUE": "the memory cannot be IPC-shared: if it comes from PyTorch's"
    " expandable_segments allocator, unset PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    "CUDA_ERROR_INVALID_DEVICE": "the two processes see different GPUs: give both the same"
    " devices (CUDA_VISIBLE_DEVICES) and pass the device ordinal as this process numbers it",
    "CUDA_ERROR_MAP_FAILED": "the exporting process is gone or the handle is stale: export"
    " again from a live process",
    "CUDA_ERROR_INVALID_HANDLE": "the handle is stale (the exporting process freed the memory"
    " or exited): export again from a live process; a reader handshakes again and maps the"
    " owner's current handles",
    "CUDA_ERROR_ALREADY_MAPPED": "this process already has that allocation mapped: close the"
    " earlier mapping first",
}


def _sym(lib: ctypes.CDLL, *names: str) -> Any:
    for n in names:
        fn = getattr(lib, n, None)
        if fn is not None:
            return fn
    raise SpecError(f"the CUDA driver lacks {names[0]}", fix="update the NVIDIA driver")


@dataclass(frozen=True)
class IpcExport:
    """What an importer needs: the allocation's handle and where the region starts in it."""

    handle: bytes
    offset: int
    nbytes: int
    device: int


def export_tensor(t: torch.Tensor, nbytes: int) -> IpcExport:
    """Export the ``nbytes`` starting at ``t.data_ptr()`` (a CUDA tensor) over CUDA IPC."""
    if t.device.type != "cuda":
        raise InvalidRequest(f"tensor on {t.device} is not CUDA memory", fix="attach VRAM")
    device = t.device.index or 0
    drv = _Driver.get()
    ptr = int(t.data_ptr())
    with drv.context(device):
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        drv.check(drv.range(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
        if ptr + nbytes > base.value + size.value:
            raise SpecError(
                f"{nbytes} bytes from {ptr:#x} run past the end of their CUDA allocation"
                f" ({base.value:#x} + {size.value})",
                fix="allocate each region in one piece (one tensor per region)",
            )
        handle = _IpcHandle()
        drv.check(drv.lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
    raw = ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_SIZE)
    return IpcExport(raw, ptr - base.value, nbytes, device)


class _ArrayInterface:
    """A ``__cuda_array_interface__`` provider that keeps its mapping alive."""

    def __init__(self, ptr: int, nbytes: int, owner: IpcMapping) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class IpcMapping:
    """An imported CUDA IPC allocation; closed when it and every tensor over it are gone."""

    def __init__(self, handle: bytes, device: int) -> None:
        if len(handle) != IPC_HANDLE_SIZE:
            raise InvalidRequest(
                f"a CUDA IPC handle is {IPC_HANDLE_SIZE} bytes, got {len(handle)}",
                field="cuda_ipc_handle",
                fix="send the cudaIpcMemHandle_t bytes unchanged",
            )
        drv = _Driver.get()
        raw = _IpcHandle()
        ctypes.memmove(ctypes.addressof(raw), handle, IPC_HANDLE_SIZE)
        ptr = ctypes.c_uint64()
        with drv.context(device):
            drv.check(
                drv.open(ctypes.byref(ptr), raw, _LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle"
            )
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            rc = drv.range(ctypes.byref(base), ctypes.byref(size), ptr.value)
        self.base = ptr.value
        self.size = int(size.value) if rc == 0 else 0
        self.device = device
        self._closer = weakref.finalize(self, _close, self.base, device)
        log.info(
            "CUDA IPC memory opened",
            extra=kv(device=device, base=f"{self.base:#x}", bytes=self.size),
        )

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    def close(self) -> None:
        """Unmap now (idempotent). Only for a caller that knows no tensor over the mapping is
        still in use (kvxferd.ipc.mapping closes a peer's set once no copy uses it)."""
        self._closer()

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 CUDA tensor over ``[offset, offset + nbytes)`` of the mapped allocation."""
        if offset < 0 or nbytes <= 0 or (self.size and offset + nbytes > self.size):
            raise SpecError(
                f"bytes [{offset}, {offset + nbytes}) are outside the imported CUDA allocation"
                f" of {self.size} bytes",
                fix="check the handle's offset and the region's size",
            )
        view = _ArrayInterface(self.base + offset, nbytes, self)
        return torch.as_tensor(view, device=f"cuda:{self.device}")


def _close(base: int, device: int) -> None:
    try:
        drv = _Driver.get()
        with drv.context(device):
            drv.check(drv.lib.cuIpcCloseMemHandle(base), "cuIpcCloseMemHandle")
        log.info("CUDA IPC memory closed", extra=kv(device=device, base=f"{base:#x}"))
    except SpecError as err:
        log.warning(
            "closing CUDA IPC memory failed",
            extra=kv(device=device, base=f"{base:#x}", error=str(err)),
        )
