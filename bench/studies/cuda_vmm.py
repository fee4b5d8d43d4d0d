"""CUDA virtual memory management through the driver API (ctypes), for the attachment study.

Allocates physical GPU memory with ``cuMemCreate`` (shareable as a POSIX file descriptor),
maps it into this process, exports it as an fd, and imports an fd from another process into a
mapping of the same physical memory. The mapping is wrapped as a torch tensor through
``__cuda_array_interface__``. Used only by ``bench.studies.attachment`` (candidate (b) of issue 7).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import torch

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_HANDLE_TYPE_FABRIC = 8
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _Prop(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@functools.cache
def _cu() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    rc = lib.cuInit(0)
    if rc != 0:
        raise RuntimeError(f"cuInit failed: CUresult {rc}")
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _cu().cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: CUresult {rc} {name.value!r}")


def _prop(device: int, handle_types: int) -> _Prop:
    p = _Prop()
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED
    p.requestedHandleTypes = handle_types
    p.location = _Location(CU_MEM_LOCATION_TYPE_DEVICE, device)
    return p


@dataclass
class Mapping:
    """A VMM mapping of ``size`` bytes at ``ptr`` on ``device`` (rounded to the granularity)."""

    ptr: int
    size: int
    device: int
    handle: int

    def tensor(self, nbytes: int) -> torch.Tensor:
        holder = _Cai(self.ptr, nbytes)
        return torch.as_tensor(holder, device=f"cuda:{self.device}")

    def export_fd(self) -> int:
        fd = ctypes.c_int(-1)
        _check(
            _cu().cuMemExportToShareableHandle(
                ctypes.byref(fd),
                ctypes.c_ulonglong(self.handle),
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                ctypes.c_ulonglong(0),
            ),
            "cuMemExportToShareableHandle",
        )
        return fd.value

    def close(self) -> None:
        cu = _cu()
        cu.cuMemUnmap(ctypes.c_ulonglong(self.ptr), ctypes.c_size_t(self.size))
        cu.cuMemAddressFree(ctypes.c_ulonglong(self.ptr), ctypes.c_size_t(self.size))
        cu.cuMemRelease(ctypes.c_ulonglong(self.handle))


class _Cai:
    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def _granularity(device: int, handle_types: int) -> int:
    g = ctypes.c_size_t(0)
    prop = _prop(device, handle_types)
    _check(
        _cu().cuMemGetAllocationGranularity(
            ctypes.byref(g), ctypes.byref(prop), CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        ),
        "cuMemGetAllocationGranularity",
    )
    return int(g.value)


def _map(handle: int, size: int, device: int) -> int:
    cu = _cu()
    ptr = ctypes.c_ulonglong(0)
    _check(
        cu.cuMemAddressReserve(
            ctypes.byref(ptr),
            ctypes.c_size_t(size),
            ctypes.c_size_t(0),
            ctypes.c_ulonglong(0),
            ctypes.c_ulonglong(0),
        ),
        "cuMemAddressReserve",
    )
    _check(
        cu.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_ulonglong(handle), 0),
        "cuMemMap",
    )
    desc = _AccessDesc(
        _Location(CU_MEM_LOCATION_TYPE_DEVICE, device), CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    )
    _check(
        cu.cuMemSetAccess(ptr, ctypes.c_size_t(size), ctypes.byref(desc), ctypes.c_size_t(1)),
        "cuMemSetAccess",
    )
    return int(ptr.value)


def allocate(nbytes: int, device: int, *, fabric: bool = False) -> Mapping:
    """Create and map ``nbytes`` (rounded up) on ``device``, shareable as a POSIX fd."""
    torch.cuda.set_device(device)
    torch.cuda.init()
    types = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | (CU_MEM_HANDLE_TYPE_FABRIC if fabric else 0)
    g = _granularity(device, types)
    size = -(-nbytes // g) * g
    handle = ctypes.c_ulonglong(0)
    prop = _prop(device, types)
    _check(
        _cu().cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), 0),
        "cuMemCreate",
    )
    return Mapping(_map(int(handle.value), size, device), size, device, int(handle.value))


def import_fd(fd: int, nbytes: int, device: int) -> Mapping:
    """Map the physical memory behind another process's exported fd into this process."""
    torch.cuda.set_device(device)
    torch.cuda.init()
    g = _granularity(device, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    size = -(-nbytes // g) * g
    handle = ctypes.c_ulonglong(0)
    _check(
        _cu().cuMemImportFromShareableHandle(
            ctypes.byref(handle),
            ctypes.c_void_p(fd),
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        ),
        "cuMemImportFromShareableHandle",
    )
    return Mapping(_map(int(handle.value), size, device), size, device, int(handle.value))
