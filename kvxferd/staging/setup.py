"""Per pull: DIRECT, STAGED, KERNEL or CMA, and the job; the daemon's strategy parts as one
value.

KERNEL (same-host GPU peers, :mod:`kvxferd.ipc`) and CMA (same-host host-memory peers,
:mod:`kvxferd.ipc.cma_reader`) are picked whenever they are eligible; a DIRECT or STAGED pull
of GPU memory over a link probed at TCP speed is refused here, before a transfer exists, unless
``transfer.allow_slow_transport``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.ranges import PullPlan, TransferPlan
from kvxferd.ipc.cma import allow_readers
from kvxferd.ipc.cma_link import NOT_CONSIDERED, CmaSide, cma_job, cma_why_not
from kvxferd.ipc.cma_reader import CmaReader
from kvxferd.ipc.eligibility import kernel_ineligible, kernel_only_refusal
from kvxferd.ipc.mapping import MappingCache, Opener, cuda_opener
from kvxferd.ipc.publish import IpcPool, Publisher
from kvxferd.ipc.reader import KernelJob, KernelReader, ReadyPull
from kvxferd.ipc.transport import refusal
from kvxferd.layout.spec import KVCacheSpec, MemoryType
from kvxferd.pool import KVPool
from kvxferd.staging.chunks import Chunk, RingInfo, split_chunks
from kvxferd.staging.facts import pair_facts
from kvxferd.staging.owner import StagingOwner
from kvxferd.staging.reader import StagedReader
from kvxferd.staging.ring import StagingRing
from kvxferd.staging.strategy import (
    Choice,
    CostModel,
    Mode,
    Strategy,
    choose,
    whole_blocks_bytes,
)
from kvxferd.transfer.engine import TransferEngine
from kvxferd.transfer.leases import LeaseTable
from kvxferd.transfer.state import TransferResult

if TYPE_CHECKING:
    from kvxferd.daemon.peers import PeerLink, RemoteDescription
    from kvxferd.staging.device import Int64Array


@dataclass(frozen=True)
class IpcSide:
    """The daemon's CUDA IPC policy and parts, for its whole life (``transfer.cuda_ipc``,
    ``transfer.kernel_max_ctas``, ``transfer.allow_slow_transport``)."""

    enabled: bool = True
    host_id: str = ""
    max_ctas: int = 0
    allow_slow_transport: bool = False
    idle_s: float = 10.0
    publisher: Publisher = field(default_factory=Publisher)
    opener: Opener = cuda_opener


@dataclass(frozen=True)
class Staging:
    """A daemon's strategy policy and, when staging is enabled, its ring and both sides."""

    mode: Mode
    model: CostModel
    ring: StagingRing | None = None
    owner: StagingOwner | None = None
    reader: StagedReader | None = None
    ipc: IpcSide = field(default_factory=IpcSide)
    kernel: KernelReader | None = None  # KERNEL pulls into this pool (VRAM pools only)
    cma_side: CmaSide = field(default_factory=CmaSide)
    cma: CmaReader | None = None  # CMA pulls into this pool (DRAM pools only)

    @property
    def info(self) -> RingInfo | None:
        return self.ring.info if self.ring is not None else None

    def ipc_export(self, pool: KVPool, generation: int) -> IpcPool | None:
        """Our regions over CUDA IPC for the handshake (None for a DRAM pool)."""
        return self.ipc.publisher.export(pool, generation)

    def close(self) -> None:
        """The pool went away (engine detached, or shutdown): stop the owner, drop mappings."""
        if self.owner is not None:
            self.owner.stop()
        if self.kernel is not None:
            self.kernel.close()
        if self.cma is not None:
            self.cma.close()

    async def quiesce(self) -> None:
        """After :meth:`close`: return once no owner-side gather reads the pool any more (the
        pulls into it are the reader's to end: kvxferd/daemon/quiesce.py)."""
        if self.owner is not None:
            await self.owner.idle()

    def kernel_ready(self, remote: RemoteDescription, plan: TransferPlan) -> ReadyPull | None:
        """A KERNEL pull's host work, done ahead while its lease confirmation is in flight
        (:meth:`KernelReader.ready`); None when it stays with the pull."""
        if self.kernel is None or remote.ipc is None:
            return None
        return self.kernel.ready(remote.key, remote.ipc, plan)

    async def kernel_pull(
        self,
        transfer_id: str,
        remote: RemoteDescription,
        *,
        peer_address: str,
        plan: TransferPlan,
        local_blocks: tuple[Int64Array, ...],
        deadline: float,
        ready: ReadyPull | None = None,
    ) -> TransferResult:
        """Run a KERNEL pull against ``remote`` as it is *now* (a re-registration during the
        lease confirmation moved its regions: the new generation is mapped, and ``ready``,
        done against the old, is not used)."""
        assert self.kernel is not None and remote.ipc is not None
        job = KernelJob(
            transfer_id, remote.agent_name, peer_address, remote.key, remote.ipc, deadline
        )
        return await self.kernel.pull(job, plan, local_blocks, ready)

    async def cma_pull(
        self,
        transfer_id: str,
        link: PeerLink,
        *,
        peer_address: str,
        plan: TransferPlan,
        local_blocks: tuple[Int64Array, ...],
        deadline: float,
    ) -> TransferResult:
        """Run a CMA pull from the process ``link`` vouches for *now*."""
        assert self.cma is not None
        job = cma_job(transfer_id, link, peer_address=peer_address, deadline=deadline)
        return await self.cma.pull(job, plan, local_blocks)


@dataclass(frozen=True)
class Decision:
    choice: Choice
    chunks: tuple[Chunk, ...] = ()


def decide(
    staging: Staging,
    *,
    local: KVCacheSpec,
    remote: KVCacheSpec,
    local_tp_size: int,
    remote_tp_size: int,
    remote_ring: RingInfo | None,
    plan: PullPlan,
    part: TransferPlan,
    peer: str,
    link: PeerLink | None = None,
) -> Decision:
    """Pick the strategy of one pull and, for STAGED, cut it into chunks. ``link``: the peer
    as handshaken (its host, CUDA IPC export and probed transport), for KERNEL and the slow
    transport refusal; raises :class:`~kvxferd.errors.SlowTransport` for that refusal."""
    remote_only = link.remote.kernel_only if link is not None and link.remote else ""
    local_only = staging.ipc.publisher.kernel_only
    if staging.mode in (Mode.DIRECT, Mode.STAGED) and not (remote_only or local_only):
        # Forced to NIXL: choose() takes neither same-host copy, so their checks (KERNEL's
        # opens the peer's mappings, CMA's probes its process) would be thrown away. A
        # KERNEL-only pool still gets them: its refusal says why KERNEL could not run.
        kernel_why: str | None = NOT_CONSIDERED
        cma_why: str | None = NOT_CONSIDERED
    else:
        kernel_why = _kernel_why(staging, local, link, part, peer)
        cma_why = (
            cma_why_not(
                staging.cma_side,
                local,
                link,
                reader=staging.cma is not None,
                nbytes=part.nbytes,
                peer=peer,
            )
            if link is not None
            else NOT_CONSIDERED
        )
    chunks: list[Chunk] = []
    if staging.mode in (Mode.AUTO, Mode.KERNEL) and (kernel_why is None or cma_why is None):
        why: str | None = "not needed: a same-host copy runs"  # choose() takes KERNEL or CMA
    else:
        # Per peer generation (kvxferd.staging.facts): computed once, dropped with it.
        facts = (
            link.remote.facts.get if link is not None and link.remote is not None else pair_facts
        )
        why, rows = facts(
            staging.info,
            remote_ring,
            local,
            remote,
            local_tp_size=local_tp_size,
            remote_tp_size=remote_tp_size,
            peer=peer,
        )
        counts = [int(a.size) for a in plan.local_kernel_blocks]
        if why is None and part.nbytes != whole_blocks_bytes(counts, rows):
            why = "the plan reads parts of blocks (TP or head slicing); staging copies whole blocks"
        if why is None and staging.info is not None and remote_ring is not None:
            slot = min(staging.info.chunk_bytes, remote_ring.chunk_bytes)
            chunks = split_chunks(counts, rows, slot)
    choice = choose(
        staging.mode,
        staging.model,
        descriptors=part.num_ranges,
        nbytes=part.nbytes,
        chunks=len(chunks),
        ineligible=why,
        kernel_ineligible=kernel_why,
        cma_ineligible=cma_why,
    )
    refused = kernel_only_refusal(  # a pool served by KERNEL only (kvxferd.ipc.eligibility)
        strategy=choice.strategy.value,
        why_not_kernel=kernel_why or f"this daemon's transfer.strategy = {staging.mode.value}",
        nbytes=part.nbytes,
        remote_kernel_only=remote_only,
        local_kernel_only=local_only,
        peer=peer,
    )
    if refused is not None:
        raise refused
    report = link.transport if link is not None else None
    if (
        choice.strategy not in (Strategy.KERNEL, Strategy.CMA)
        and part.nbytes > 0
        and report is not None
        and report.slow
        and not staging.ipc.allow_slow_transport
    ):
        raise refusal(report, peer, choice.strategy.value)
    if choice.strategy is Strategy.CMA and link is not None and link.owner is not None:
        choice = replace(choice, reason=f"{choice.reason}; owner process {link.owner.pid}")
    if choice.strategy is not Strategy.STAGED or part.nbytes == 0:
        return Decision(choice)
    return Decision(choice, tuple(chunks))


def _kernel_why(
    staging: Staging, local: KVCacheSpec, link: PeerLink | None, part: TransferPlan, peer: str
) -> str | None:
    """Why this pull cannot be KERNEL; opens the peer generation's mappings (once) if it can."""
    if part.nbytes == 0:
        return "nothing to copy"
    if link is None or link.remote is None:
        return "not considered"
    remote = link.remote
    why = kernel_ineligible(
        enabled=staging.ipc.enabled,
        local_memory=local.regions[0].memory,
        remote_memory=remote.info.spec.regions[0].memory,
        my_host=staging.ipc.host_id,
        remote_host=remote.host_id,
        remote_ipc=remote.ipc,
        remote_regions=int(remote.regions.shape[0]),
        open_failure=None,
        peer=peer,
    )
    if why is not None:
        return why
    if staging.kernel is None:
        return "this daemon has no pool to copy into on a GPU"
    assert remote.ipc is not None
    failed = staging.kernel.prepare(remote.key, remote.ipc)
    if failed is not None and not remote.kernel_only:
        return f"opening peer {peer}'s CUDA IPC handles failed: {failed}"
    # A KERNEL-only owner has no other strategy, and its handles may be an earlier
    # generation's (its engine re-attached): the lease confirmation handshakes again, the pull
    # maps the current ones, and fails with the open error if they do not open either.
    return None


@dataclass(frozen=True)
class StagingFactory:
    """Everything staging needs except the pool, so that an attached daemon can rebuild its
    owner and reader around each engine's pool while keeping one ring registered for life.

    The ring was allocated and registered before the engine was built, and the engine's local
    region table always ends with the ring's row (see :meth:`local_rows`), so its region index
    is the current pool's region count."""

    mode: str
    model: CostModel
    ring: StagingRing | None
    engine: TransferEngine
    leases: LeaseTable
    grant_timeout_s: float
    max_block_ids: int
    ipc: IpcSide = field(default_factory=IpcSide)
    cma: CmaSide = field(default_factory=CmaSide)

    def local_rows(self, pool_rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The engine's local region table for a pool: its regions, then the ring's row."""
        if self.ring is None:
            return pool_rows
        return np.vstack([pool_rows, np.array([self.ring.info.row()], dtype=np.int64)])

    def build(self, pool: KVPool | None) -> Staging:
        """The strategy parts around ``pool``; call on the event loop (the owner subscribes to
        lease ends, the kernel reader sweeps idle mappings). Without a pool (detached) every
        pull is DIRECT; without a ring none is STAGED; KERNEL needs a VRAM pool."""
        kernel = self._kernel(pool)
        cma = self._cma(pool)
        if self.ring is None or pool is None:
            return Staging(
                Mode(self.mode), self.model, ipc=self.ipc, kernel=kernel, cma_side=self.cma, cma=cma
            )
        owner = StagingOwner(
            self.ring,
            pool,
            self.leases,
            grant_timeout_s=self.grant_timeout_s,
            max_block_ids=self.max_block_ids,
        )
        owner.start()
        reader = StagedReader(
            self.ring,
            owner.copier,
            self.engine,
            staging_region=len(pool.spec.regions),
        )
        return Staging(
            Mode(self.mode),
            self.model,
            self.ring,
            owner,
            reader,
            ipc=self.ipc,
            kernel=kernel,
            cma_side=self.cma,
            cma=cma,
        )

    def _cma(self, pool: KVPool | None) -> CmaReader | None:
        """CMA pulls into a host-memory pool; as an owner, let same-user readers read us where
        Yama's ptrace_scope = 1 would refuse them (docs/strategies.md, "CMA")."""
        if pool is None or not self.cma.enabled or pool.memory_type is not MemoryType.DRAM:
            return None
        allow_readers()
        return CmaReader(pool.region_rows(), threads=self.cma.threads, readv=self.cma.readv)

    def _kernel(self, pool: KVPool | None) -> KernelReader | None:
        if pool is None or not self.ipc.enabled or pool.memory_type is not MemoryType.VRAM:
            return None
        device = next(iter(pool.tensors.values())).device.index or 0
        cache = MappingCache(device=device, opener=self.ipc.opener, idle_s=self.ipc.idle_s)
        reader = KernelReader(pool, cache, max_ctas=self.ipc.max_ctas)
        reader.start()
        return reader
