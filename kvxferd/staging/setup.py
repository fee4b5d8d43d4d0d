"""Per pull: DIRECT or STAGED, and the STAGED job; the daemon's staging parts as one value."""

from __future__ import annotations

from dataclasses import dataclass

from kvxferd.blocks.plan import PullPlan
from kvxferd.blocks.ranges import TransferPlan
from kvxferd.layout.spec import KVCacheSpec
from kvxferd.pool import KVPool
from kvxferd.staging.chunks import Chunk, RingInfo, split_chunks
from kvxferd.staging.owner import StagingOwner
from kvxferd.staging.reader import RemoteError, StagedReader
from kvxferd.staging.ring import StagingRing
from kvxferd.transfer.engine import TransferEngine
from kvxferd.transfer.leases import LeaseTable
from kvxferd.transfer.strategy import (
    Choice,
    CostModel,
    Mode,
    Strategy,
    choose,
    group_row_bytes,
    staged_ineligible,
    whole_blocks_bytes,
)


@dataclass(frozen=True)
class Staging:
    """A daemon's strategy policy and, when staging is enabled, its ring and both sides."""

    mode: Mode
    model: CostModel
    ring: StagingRing | None = None
    owner: StagingOwner | None = None
    reader: StagedReader | None = None

    @property
    def info(self) -> RingInfo | None:
        return self.ring.info if self.ring is not None else None


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
) -> Decision:
    """Pick the strategy of one pull and, for STAGED, cut it into chunks."""
    why = staged_ineligible(
        local,
        remote,
        local_tp_size=local_tp_size,
        remote_tp_size=remote_tp_size,
        local_ring=staging.info,
        remote_ring=remote_ring,
        peer=peer,
    )
    counts = [int(a.size) for a in plan.local_kernel_blocks]
    rows = group_row_bytes(local)
    chunks: list[Chunk] = []
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
    )
    if choice.strategy is Strategy.DIRECT or part.nbytes == 0:
        return Decision(choice)
    return Decision(choice, tuple(chunks))


def build_staging(
    *,
    mode: str,
    model: CostModel,
    ring: StagingRing | None,
    pool: KVPool,
    engine: TransferEngine,
    leases: LeaseTable,
    grant_timeout_s: float,
    max_block_ids: int,
    call_metadata: tuple[tuple[str, str], ...],
    remote_error: RemoteError,
) -> Staging:
    """The daemon's staging parts; call on the event loop (the owner subscribes to leases).

    ``ring`` was allocated and registered before the engine was built, and the engine's local
    region table ends with the ring's row (so its region index is the pool's region count)."""
    if ring is None:
        return Staging(Mode(mode), model)
    owner = StagingOwner(
        ring, pool, leases, grant_timeout_s=grant_timeout_s, max_block_ids=max_block_ids
    )
    owner.start()
    reader = StagedReader(
        ring,
        owner.copier,
        engine,
        staging_region=len(pool.spec.regions),
        call_metadata=call_metadata,
        remote_error=remote_error,
    )
    return Staging(Mode(mode), model, ring, owner, reader)
