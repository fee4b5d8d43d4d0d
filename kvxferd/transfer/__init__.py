"""Data plane above NIXL: plans to descriptors, the transfer engine, owner-side leases.

Owns: turning a :class:`kvxferd.blocks.ranges.TransferPlan` plus both sides' region tables
into NIXL descriptors (:mod:`.descriptors`, pure), admitting transfers under per-peer byte
budgets (:mod:`.engine`) and tracking them on the NIXL thread to a terminal
:class:`TransferStatus` under deadlines (:mod:`.inflight`), the owner-side lease table
(:mod:`.leases`, pure, injected clock; its values in :mod:`.lease`), the transfer-done
notification format (:mod:`.notify`, pure) and the glue from NIXL notifications to leases
(:mod:`.owner`).

Must not import: ``nixl`` (only through :mod:`kvxferd.nixl`), ``grpc``, ``kvxferd.service``.
The pure modules (descriptors, lease, leases, notify, state) import neither NIXL nor asyncio.
"""

from kvxferd.transfer.descriptors import RegionTable, build_descriptors, coalesce
from kvxferd.transfer.engine import EngineOptions, Transfer, TransferEngine
from kvxferd.transfer.leases import Lease, LeaseTable, Released, ReleaseReason
from kvxferd.transfer.notify import Notification, NotifKind
from kvxferd.transfer.owner import NotificationPump, ReleaseFeed
from kvxferd.transfer.state import TransferResult, TransferStatus

__all__ = [
    "EngineOptions",
    "Lease",
    "LeaseTable",
    "NotifKind",
    "Notification",
    "NotificationPump",
    "RegionTable",
    "ReleaseFeed",
    "ReleaseReason",
    "Released",
    "Transfer",
    "TransferEngine",
    "TransferResult",
    "TransferStatus",
    "build_descriptors",
    "coalesce",
]
