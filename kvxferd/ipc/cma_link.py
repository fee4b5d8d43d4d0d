"""CMA and a peer link: whether a pull from the link's peer can be CMA, and the job that reads
the process the link vouches for.

The link (:class:`kvxferd.daemon.peers.PeerLink`) keeps an :class:`~kvxferd.ipc.cma.OwnerProcess`
once a Heartbeat through the owner's same-host socket reached the handshaken instance; this
module turns it into the facts :func:`~kvxferd.ipc.cma_eligibility.cma_ineligible` decides on,
probes the process once (the first time a pull could use it), and at copy time builds the job
only from a process the link still vouches for over the very connection that named it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvxferd.ipc.cma import OwnerProcess, ReadV, process_vm_readv
from kvxferd.ipc.cma_eligibility import OwnerFacts, cma_ineligible
from kvxferd.ipc.cma_reader import CmaJob
from kvxferd.layout.spec import KVCacheSpec, MemoryType

if TYPE_CHECKING:
    from kvxferd.daemon.peers import PeerLink

NOT_CONSIDERED = "not considered"  # not a host-memory pull: KERNEL's reason applies


@dataclass(frozen=True)
class CmaSide:
    """The daemon's CMA policy for its whole life (``transfer.cma``, ``transfer.cma_threads``);
    ``readv``: the system call (tests inject faults there)."""

    enabled: bool = True
    threads: int = 2
    readv: ReadV = process_vm_readv


def owner_facts(link: PeerLink) -> OwnerFacts | None:
    """What the link knows about its peer's process now (None: no process known)."""
    owner, remote = link.owner, link.remote
    if owner is None or remote is None:
        return None
    return OwnerFacts(
        pid=owner.pid,
        same_channel=owner.same_channel(link.client.local),
        same_incarnation=owner.key == remote.key,
        dropped=owner.dropped,
        exited=owner.pid > 0 and owner.exited(),
    )


def cma_why_not(
    side: CmaSide,
    local: KVCacheSpec,
    link: PeerLink,
    *,
    reader: bool,
    nbytes: int,
    peer: str,
) -> str | None:
    """Why a pull of ``nbytes`` from ``link``'s peer cannot be CMA (:data:`NOT_CONSIDERED`
    where it is not a host-memory pull); probes the owner's process once if it can.
    ``reader``: this daemon has a CMA reader (a host-memory pool, ``transfer.cma`` on)."""
    remote = link.remote
    if nbytes == 0 or remote is None:
        return NOT_CONSIDERED
    mine, theirs = local.regions[0].memory, remote.info.spec.regions[0].memory
    if MemoryType.VRAM in (mine, theirs):
        return NOT_CONSIDERED
    facts = owner_facts(link)

    def why(f: OwnerFacts | None) -> str | None:
        return cma_ineligible(
            enabled=side.enabled and reader,
            local_memory=mine,
            remote_memory=theirs,
            owner=f,
            peer=peer,
        )

    first = why(facts)
    if first is not None or facts is None or link.owner is None:
        return first
    base, length = int(remote.regions[0, 0]), int(remote.regions[0, 1])
    failed = link.owner.ensure_probed(base, length, side.readv)
    return None if failed is None else why(replace(facts, probe_failure=failed))


def gone(why: str) -> OwnerProcess:
    """A process no link vouches for: a CMA pull against it fails before any read."""
    return OwnerProcess(0, 0, ("", "", 0), 0, None, dropped=why)


def cma_job(transfer_id: str, link: PeerLink, *, peer_address: str, deadline: float) -> CmaJob:
    """The job of a CMA pull from the process ``link`` vouches for *now*: one dropped, replaced
    or reached over another connection since the pull was planned is never read."""
    remote = link.remote
    assert remote is not None
    owner = link.owner
    if owner is None or owner.key != remote.key:
        owner = gone("the peer was handshaken again or invalidated after the pull was planned")
    elif not owner.same_channel(link.client.local):
        owner = gone("its same-host socket reconnected after the pull was planned")
    return CmaJob(transfer_id, remote.agent_name, peer_address, owner, remote.regions, deadline)
