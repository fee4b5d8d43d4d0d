"""What a KERNEL pull carries (:mod:`kvxferd.ipc.reader`): the job, the host work done ahead of
its lease confirmation, and where its time went."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvxferd.blocks.ranges import TransferPlan
from kvxferd.ipc.armed import Armed
from kvxferd.ipc.mapping import Key, PeerMaps
from kvxferd.ipc.publish import IpcPool
from kvxferd.kernels import CheckedCopy
from kvxferd.pool import KVPool


@dataclass(frozen=True)
class KernelJob:
    """One KERNEL pull: which peer generation to read and by when."""

    transfer_id: str
    peer_agent: str
    peer_address: str
    key: Key  # (agent, instance_id, registration_generation) the pull was planned against
    ipc: IpcPool
    deadline: float  # monotonic


def region_bytes(pool: KVPool) -> list[torch.Tensor]:
    """Each region of ``pool`` as a 1-D uint8 tensor over exactly its registered bytes."""
    out = []
    for r, m in zip(pool.spec.regions, pool.memory, strict=True):
        t = pool.tensors[r.name]
        storage = torch.empty(0, dtype=torch.uint8, device=t.device)
        offset = t.storage_offset() * t.element_size()
        out.append(storage.set_(t.untyped_storage(), offset, (m.nbytes,), (1,)))
    return out


@dataclass(frozen=True, eq=False)
class ReadyPull:
    """A KERNEL pull's host work, done before its lease is confirmed (:meth:`KernelReader.ready`):
    the plan cut into pieces, checked against both sides and its launch tables built, for the
    peer generation's mappings ``maps``. A pull of that plan from those same mappings only
    launches; any other redoes the work (the regions it was checked against are gone)."""

    plan: TransferPlan
    maps: PeerMaps
    copy: CheckedCopy
    runs: int
    cut: float  # seconds: the pieces cut
    check: float  # seconds: checked and the tables built
    # The copy launched already, behind a closed gate (kvxferd.ipc.armed), or None: it is
    # launched once the lease is confirmed.
    armed: Armed | None = None


@dataclass
class PullTimes:
    """Where the last KERNEL pull's time went (seconds): cutting the plan into pieces, the
    launch (every piece checked against both sides' regions and the launch tables built, unless
    that was done before the confirmation, then the tables' upload and the kernel launch), the
    wait for the copy's event, and the whole pull seen from the event loop (the rest of it is
    the thread hop, or the loop's turns between polls). ``inline``: the host work ran on the
    loop; ``polls``: the loop turns it yielded while polling the event; ``thread_wait``: the
    polls ran out and the wait ended in a worker thread; ``ready``: cut and check ran before
    the confirmation (:class:`ReadyPull`; ``cut`` and ``check`` are then its times)."""

    cut: float = 0.0
    launch: float = 0.0
    wait: float = 0.0
    call: float = 0.0
    pieces: int = 0
    inline: bool = False
    polls: int = 0
    thread_wait: bool = False
    check: float = 0.0  # the pieces checked and the tables built (part of launch before)
    ready: bool = False  # cut and check were done before the confirmation (ReadyPull)
    armed: bool = False  # launched before the confirmation, its gate opened at the decision
