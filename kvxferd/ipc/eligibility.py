"""Why a pull cannot be KERNEL (pure): the reasons, in the order they are checked.

KERNEL needs: the feature on (``transfer.cuda_ipc``), both pools in VRAM, the peer on this
host and IPC namespace (equal ``host_id``), the peer's CUDA IPC export for every region of its
spec, and that export opened here (the mapping cache says whether opening failed). It copies
exactly the byte ranges DIRECT would post (the planner's), so whatever DIRECT can read (TP
slices, trimmed prefixes), KERNEL can.

A pool served by KERNEL only (engine-attached IMPORTED VRAM, not registered with NIXL:
:attr:`kvxferd.ipc.publish.IpcPool.kernel_only`) is read and written with KERNEL or not at all:
:func:`kernel_only_refusal` is the StartPull refusal of any other strategy, whether the owner's
pool or this daemon's own is the KERNEL-only one.
"""

from __future__ import annotations

from kvxferd.errors import SlowTransport
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


def kernel_only_refusal(
    *,
    strategy: str,
    why_not_kernel: str,
    nbytes: int,
    remote_kernel_only: str,
    local_kernel_only: str,
    peer: str,
) -> SlowTransport | None:
    """The refusal of a pull that would move bytes with NIXL (``strategy``: DIRECT or STAGED;
    ``why_not_kernel``: why it is not KERNEL) from a KERNEL-only owner (``remote_kernel_only``:
    the owner's ``kernel_only_reason``) or into this daemon's own KERNEL-only pool
    (``local_kernel_only``); None for a KERNEL pull, a pull that moves nothing, or pools that
    NIXL serves. FAILED_PRECONDITION on the wire (a slow or broken NIXL path refused up front,
    like :func:`kvxferd.ipc.transport.refusal`)."""
    if strategy == "KERNEL" or nbytes == 0 or not (remote_kernel_only or local_kernel_only):
        return None
    if remote_kernel_only:
        return SlowTransport(
            f"peer {peer} serves its pool with KERNEL pulls only ({remote_kernel_only}), and"
            f" this pull cannot be KERNEL: {why_not_kernel}; a {strategy} pull would read the"
            " unregistered memory over NIXL",
            field="peer_address",
            fix="pull from a decode daemon on the owner's host (same IPC namespace) with"
            " transfer.cuda_ipc = true and transfer.strategy = auto or kernel, or attach the"
            " owner's engine with mode='owned' (the daemon allocates; NIXL reads it at full"
            " speed from any host); see docs/attachment.md",
        )
    return SlowTransport(
        f"this daemon's pool is written with KERNEL pulls only ({local_kernel_only}), and this"
        f" pull from {peer} cannot be KERNEL: {why_not_kernel}; a {strategy} pull would write"
        " the unregistered memory over NIXL",
        field="peer_address",
        fix="pull from an owner on this host with its pool in GPU memory and"
        " transfer.cuda_ipc = true on both daemons, or attach this daemon's engine with"
        " mode='owned'; see docs/attachment.md",
    )
