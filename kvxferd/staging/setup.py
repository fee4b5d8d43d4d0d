"""Per pull: DIRECT or STAGED, and the STAGED job; the daemon's staging parts as one value."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxferd.blocks.plan import PullPlan
from kvxferd.blocks.ranges import TransferPlan
from kvxferd.layout.spec import KVCacheSpec
from kvxferd.pool import KVPool
from kvxferd.staging.chunks import Chunk, RingInfo, split_chunks
from kvxferd.staging.owner import StagingOwner
from kvxferd.staging.reader import StagedReader
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

    def local_rows(self, pool_rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The engine's local region table for a pool: its regions, then the ring's row."""
        if self.ring is None:
            return pool_rows
        return np.vstack([pool_rows, np.array([self.ring.info.row()], dtype=np.int64)])

    def build(self, pool: KVPool | None) -> Staging:
        """The staging parts around ``pool``; call on the event loop (the owner subscribes to
        lease ends). Without a pool (detached) or a ring, every pull is DIRECT."""
        if self.ring is None or pool is None:
            return Staging(Mode(self.mode), self.model)
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
        return Staging(Mode(self.mode), self.model, self.ring, owner, reader)
