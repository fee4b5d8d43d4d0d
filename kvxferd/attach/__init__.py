"""Sharing KV memory between an engine process and the daemon: POSIX shm and CUDA IPC.

Owns: creating, mapping and unmapping shared host memory (:mod:`.shm`), exporting and
importing CUDA IPC handles through the CUDA driver API (:mod:`.cuda_ipc`), and viewing raw
shared bytes as a region's tensor (:mod:`.views`). Both sides use it: the daemon
(:mod:`kvxferd.daemon.attach`) and the engine client (:mod:`kvxferd.engine`).

Must not import: ``nixl``, ``grpc``, ``kvxferd.service``, ``kvxferd.daemon``. A mapping is
unmapped only when the last tensor viewing it is gone (the tensors hold the mapping), so no
code path can read or write memory that was unmapped under it.
"""

from kvxferd.attach.shm import ShmSegment, shm_path
from kvxferd.attach.views import region_tensor, strided_tensor

__all__ = ["ShmSegment", "region_tensor", "shm_path", "strided_tensor"]
