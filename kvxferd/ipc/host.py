"""Who shares a host, which GPU is which, and the UCX environment for same-host GPUs.

* :func:`host_id`: a digest of the kernel's boot ID and this process's IPC namespace. Two
  processes with the same value run on one host in one IPC namespace, which is what opening
  each other's CUDA IPC handles needs (docs/strategies.md, KERNEL).
* :func:`device_uuid`: the GPU's UUID (``GPU-...``) for a CUDA ordinal *of this process*; the
  handshake carries UUIDs because two processes may number their GPUs differently
  (``CUDA_VISIBLE_DEVICES``). :func:`device_ordinal` maps one back.
* :func:`prepare_ucx_env`: UCX 1.23 (inside nixl-cu13 1.5.1) turns cuda_ipc GET zero-copy off
  on a GPU without NVLink, so a READ between two processes on that GPU (or across PCIe) runs as
  active messages over TCP loopback at ~0.4 GB/s (docs/nixl.md §7). Before NIXL starts, the
  daemon sets ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` itself when its pool is on such a GPU and the
  operator did not set the variable.

Driver and NVML calls go through ctypes (``libcuda.so.1``, ``libnvidia-ml.so.1``); on a machine
without them every answer is "unknown" (``None``), never an exception.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import socket
import threading
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

from kvxferd.logs import kv

log = logging.getLogger(__name__)

GET_ZCOPY_VAR = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
_NVLINK_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS

_lock = threading.Lock()
_cache: dict[str, str] = {}


def host_id() -> str:
    """16 hex digits naming (host boot, IPC namespace); stable for the process's life."""
    with _lock:
        found = _cache.get("host_id")
        if found is None:
            found = _cache["host_id"] = _compute_host_id()
        return found


def _compute_host_id() -> str:
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("no-boot-id")
    try:
        parts.append(str(os.stat("/proc/self/ns/ipc").st_ino))
    except OSError:
        parts.append("no-ipc-ns")
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()


def _libcuda() -> ctypes.CDLL | None:
    try:
        from kvxferd.attach.cuda_ipc import _Driver

        return _Driver.get().lib
    except Exception:
        return None


def device_uuid(ordinal: int) -> str | None:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` of CUDA device ``ordinal`` as this process
    numbers it; None when there is no driver or no such device."""
    lib = _libcuda()
    if lib is None:
        return None
    dev = ctypes.c_int()
    if lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        return None
    raw = (ctypes.c_ubyte * 16)()
    get = getattr(lib, "cuDeviceGetUuid_v2", None) or getattr(lib, "cuDeviceGetUuid", None)
    if get is None or get(raw, dev) != 0:
        return None
    return format_uuid(bytes(raw))


def format_uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def device_ordinal(uuid: str, uuids: Callable[[], list[str | None]] | None = None) -> int | None:
    """This process's ordinal of the GPU named ``uuid``; None when it is not visible here."""
    known = uuids() if uuids is not None else visible_uuids()
    for i, u in enumerate(known):
        if u is not None and u.lower() == uuid.lower():
            return i
    return None


def visible_uuids() -> list[str | None]:
    lib = _libcuda()
    if lib is None:
        return []
    count = ctypes.c_int()
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return []
    return [device_uuid(i) for i in range(count.value)]


def has_nvlink(uuid: str) -> bool | None:
    """Whether the GPU named ``uuid`` has an active NVLink (NVML); None when unknown."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    init = getattr(nvml, "nvmlInit_v2", None) or getattr(nvml, "nvmlInit", None)
    if init is None or init() != 0:
        return None
    try:
        handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)) != 0:
            return None
        active = ctypes.c_uint()
        for link in range(_NVLINK_MAX_LINKS):
            rc = nvml.nvmlDeviceGetNvLinkState(handle, link, ctypes.byref(active))
            if rc == 0 and active.value:
                return True
        return False
    finally:
        nvml.nvmlShutdown()


@dataclass(frozen=True)
class UcxEnvNote:
    """What :func:`prepare_ucx_env` did and why (logged at start, documented)."""

    set_get_zcopy: bool
    reason: str


def decide_get_zcopy(
    device: str, env: MutableMapping[str, str], nvlink: Callable[[], bool | None]
) -> UcxEnvNote:
    """Pure decision: set ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` for a CUDA pool on a GPU with no
    NVLink, unless the operator set the variable (any value wins)."""
    if not device.startswith("cuda"):
        return UcxEnvNote(False, "host-memory pool: cuda_ipc is not used")
    if GET_ZCOPY_VAR in env:
        return UcxEnvNote(False, f"{GET_ZCOPY_VAR}={env[GET_ZCOPY_VAR]!r} set by the operator")
    link = nvlink()
    if link is None:
        return UcxEnvNote(
            False,
            "could not tell whether the GPU has NVLink (no NVML); if READs between GPUs of this"
            f" host run over TCP (ListPeers read_transport), set {GET_ZCOPY_VAR}=y",
        )
    if link:
        return UcxEnvNote(False, "the GPU has NVLink: UCX enables cuda_ipc GET zero-copy itself")
    env[GET_ZCOPY_VAR] = "y"
    return UcxEnvNote(
        True,
        "the GPU has no NVLink, where UCX 1.23 turns cuda_ipc GET zero-copy off and READs"
        " between GPUs of this host would run over TCP (docs/nixl.md §7); unset by setting"
        f" {GET_ZCOPY_VAR}=n",
    )


def prepare_ucx_env(device: str, env: MutableMapping[str, str] | None = None) -> UcxEnvNote:
    """Call before the NIXL agent is created (UCX reads its configuration then)."""
    target: MutableMapping[str, str] = os.environ if env is None else env

    def nvlink() -> bool | None:
        ordinal = int(device.partition(":")[2] or 0)
        uuid = device_uuid(ordinal)
        return None if uuid is None else has_nvlink(uuid)

    note = decide_get_zcopy(device, target, nvlink)
    log.info(
        "ucx environment",
        extra=kv(set=f"{GET_ZCOPY_VAR}=y" if note.set_get_zcopy else "", why=note.reason),
    )
    return note
