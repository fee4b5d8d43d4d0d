"""The one-descriptor READs of STAGED pulls, prepared once and posted many times.

A staged chunk is read from one owner slot into one local slot: one descriptor each side,
whatever the chunk holds. Both slots are fixed regions of registered rings, so the READ's
descriptors depend only on (peer, local slot, owner slot, bytes): :class:`SlotReads` builds
them through :meth:`TransferEngine.prepare` (which checks them against both sides' registered
regions) the first time a pair is read and posts the prepared READ under each chunk's own
transfer ID afterwards, so an announced chunk costs no plan, no descriptor build and no bounds
check on the hot path. An entry made stale by a re-handshake or a pool swap
(:meth:`TransferEngine.is_current`) is prepared again. The table is bounded: slots x slots x
the few chunk sizes a pull cuts, per peer.
"""

from __future__ import annotations

import numpy as np

from kvxferd.blocks.ranges import RegionRanges, TransferPlan
from kvxferd.transfer import Transfer, TransferEngine
from kvxferd.transfer.engine import Prepared

MAX_ENTRIES = 4096  # cleared past this (peers come and go; a live pull refills what it uses)


class SlotReads:
    """Prepared slot-to-slot READs of ``engine`` into the registered region ``staging_region``
    (this daemon's ring) from the same-indexed region of each peer (its ring)."""

    def __init__(self, engine: TransferEngine, staging_region: int) -> None:
        self.engine = engine
        self.staging_region = staging_region
        self._prepared: dict[tuple[str, int, int, int], Prepared] = {}

    def post(
        self,
        transfer_id: str,
        peer: str,
        local_offset: int,
        remote_offset: int,
        nbytes: int,
        *,
        timeout_s: float,
    ) -> Transfer:
        """READ ``nbytes`` at ``remote_offset`` of ``peer``'s ring into ``local_offset`` of
        ours (offsets inside the rings; the engine refuses anything outside them)."""
        key = (peer, local_offset, remote_offset, nbytes)
        prep = self._prepared.get(key)
        if prep is None or not self.engine.is_current(prep):
            if len(self._prepared) >= MAX_ENTRIES:
                self._prepared.clear()
            plan = TransferPlan(
                ranges=(
                    RegionRanges(
                        self.staging_region,
                        "staging",
                        np.array([local_offset], dtype=np.int64),
                        np.array([remote_offset], dtype=np.int64),
                        np.array([nbytes], dtype=np.int64),
                    ),
                )
            )
            prep = self.engine.prepare(transfer_id, peer, plan)
            self._prepared[key] = prep
        return self.engine.submit_prepared(prep, timeout_s=timeout_s, transfer_id=transfer_id)

    def __len__(self) -> int:
        return len(self._prepared)


__all__ = ["SlotReads"]
