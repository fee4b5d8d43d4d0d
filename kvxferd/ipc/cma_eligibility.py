"""Why a pull cannot be CMA (pure): the reasons, in the order they are checked.

CMA needs: the feature on (``transfer.cma``), both pools in host memory, the owner reached over
its same-host Peer socket with the kernel naming its process there (``SO_PEERCRED``; pid 0 means
the owner is in a PID namespace this daemon cannot see), that very connection still being the
link's channel for the handshaken incarnation, and the probe read of the owner's first region
having worked. It copies exactly the byte ranges DIRECT would read (the planner's), so whatever
DIRECT can read (TP slices, trimmed prefixes), CMA can.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxferd.layout.spec import MemoryType


@dataclass(frozen=True)
class OwnerFacts:
    """What the reader knows about the owner's process for one pull (plain values)."""

    pid: int
    same_channel: bool  # the verified connection is still the link's same-host channel
    same_incarnation: bool  # verified for the incarnation the pull was planned against
    dropped: str = ""  # why the link stopped vouching for it ("" while it does)
    exited: bool = False
    probe_failure: str | None = None


def cma_ineligible(
    *,
    enabled: bool,
    local_memory: MemoryType,
    remote_memory: MemoryType,
    owner: OwnerFacts | None,
    peer: str,
) -> str | None:
    """None when a pull from ``peer`` can be CMA, else why not (one line, with the fix)."""
    if not enabled:
        return "this daemon's transfer.cma = false"
    if local_memory is not MemoryType.DRAM:
        return "this daemon's pool is in GPU memory (CMA copies between host-memory pools)"
    if remote_memory is not MemoryType.DRAM:
        return f"peer {peer}'s pool is in GPU memory (CMA copies between host-memory pools)"
    if owner is None:
        return (
            f"peer {peer} is not reached over its same-host Peer socket (another host, or"
            " peers.local_socket = off on either daemon, or the socket did not answer as the"
            " handshaken instance), so its process is unknown"
        )
    if owner.pid <= 0:
        return (
            f"peer {peer}'s process is not visible in this daemon's PID namespace (SO_PEERCRED"
            " gave pid 0): run both daemons in one PID namespace (a pod with"
            " shareProcessNamespace: true, or docker --pid=host / --pid=container:...)"
        )
    if owner.dropped:
        return f"peer {peer}'s process is no longer vouched for: {owner.dropped}"
    if not owner.same_incarnation:
        return f"peer {peer} re-registered or restarted since its process was verified"
    if not owner.same_channel:
        return (
            f"peer {peer}'s same-host socket reconnected or was dropped since its process was"
            " verified (the next handshake verifies it again)"
        )
    if owner.exited:
        return f"peer {peer}'s process {owner.pid} has exited"
    if owner.probe_failure is not None:
        return f"reading peer {peer}'s memory failed: {owner.probe_failure}"
    return None
