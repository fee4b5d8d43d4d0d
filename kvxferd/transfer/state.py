"""Transfer states and results as values (pure)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvxferd.errors import KvxferdError

Int64Array = npt.NDArray[np.int64]


class TransferStatus(enum.Enum):
    QUEUED = "QUEUED"  # accepted, not posted yet
    IN_PROGRESS = "IN_PROGRESS"  # posted to NIXL
    DONE = "DONE"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    EXPIRED = "EXPIRED"  # still in progress at its deadline; handle released

    @property
    def terminal(self) -> bool:
        return self not in (TransferStatus.QUEUED, TransferStatus.IN_PROGRESS)


@dataclass(frozen=True)
class TransferResult:
    """How a transfer ended. ``invalid_blocks`` (per KV group, local kernel block IDs) is empty
    on DONE and the plan's ``local_kernel_blocks`` otherwise: those blocks hold partial data."""

    transfer_id: str
    peer: str
    status: TransferStatus
    reason: str = ""
    error: KvxferdError | None = None
    invalid_blocks: tuple[Int64Array, ...] = field(default=())
    nbytes: int = 0
    descriptors: int = 0
    elapsed_s: float = 0.0
    post_us: int | None = None
    xfer_us: int | None = None
    nixl_descriptors: int | None = None
    post_started_at: float = 0.0  # engine clock (monotonic) when the post call began; 0 if never
    posted_at: float = 0.0  # engine clock when NIXL accepted the post; 0 if never
    completed_at: float = 0.0  # engine clock when the end was seen

    @classmethod
    def ended(
        cls,
        transfer_id: str,
        peer: str,
        status: TransferStatus,
        error: KvxferdError | None,
        local_blocks: tuple[Int64Array, ...],
        *,
        nbytes: int,
        descriptors: int,
        elapsed_s: float,
        posted_at: float = 0.0,
        completed_at: float = 0.0,
    ) -> TransferResult:
        """A copy that ran outside NIXL (KERNEL, CMA): every local block invalid unless DONE."""
        return cls(
            transfer_id,
            peer,
            status,
            reason=str(error) if error else "",
            error=error,
            invalid_blocks=() if status is TransferStatus.DONE else local_blocks,
            nbytes=nbytes,
            descriptors=descriptors,
            elapsed_s=elapsed_s,
            posted_at=posted_at,
            completed_at=completed_at,
        )

    @property
    def gbps(self) -> float:
        return self.nbytes / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0
