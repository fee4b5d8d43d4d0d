"""Why a pull cannot be KERNEL (pure): the reasons, in the order they are checked.

KERNEL needs: the feature on (``transfer.cuda_ipc``), both pools in VRAM, the peer on this
host and IPC namespace (equal ``host_id``), the peer's CUDA IPC export for every region of its
spec, and that export opened here (the mapping cache says whether opening failed). It copies
exactly the byte ranges DIRECT would post (the planner's), so whatever DIRECT can read (TP
slices, trimmed prefixes), KERNEL can.
"""

from __future__ import annotations

from kvxferd.ipc.publish import IpcPool
from kvxferd.layout.spec import MemoryType


def kernel_ineligible(
    *,
    enabled: bool,
    local_memory: MemoryType,
    remote_memory: MemoryType,
    my_host: str,
    remote_host: str,
    remote_ipc: IpcPool | None,
    remote_regions: int,
    open_failure: str | None,
    peer: str,
) -> str | None:
    """None when a pull from ``peer`` can be KERNEL, else why not (one line)."""
    if not enabled:
        return "this daemon's transfer.cuda_ipc = false"
    if local_memory is not MemoryType.VRAM:
        return "this daemon's pool is in host memory (KERNEL copies between GPU pools)"
    if remote_memory is not MemoryType.VRAM:
        return f"peer {peer}'s pool is in host memory (KERNEL copies between GPU pools)"
    if not remote_host:
        return f"peer {peer} does not say which host it runs on (an older kvxferd)"
    if remote_host != my_host:
        return f"peer {peer} runs on another host or IPC namespace (CUDA IPC is same-host only)"
    if remote_ipc is None:
        return f"peer {peer} publishes no CUDA IPC handles (an older kvxferd)"
    if not remote_ipc.regions:
        return f"peer {peer} publishes no CUDA IPC handles: {remote_ipc.unavailable}"
    if len(remote_ipc.regions) != remote_regions:
        return (
            f"peer {peer} exports {len(remote_ipc.regions)} CUDA IPC regions for"
            f" {remote_regions} registered regions"
        )
    if open_failure is not None:
        return f"opening peer {peer}'s CUDA IPC handles failed: {open_failure}"
    return None
