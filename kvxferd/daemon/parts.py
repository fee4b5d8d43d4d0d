"""What the owner and reader roles of a daemon share: its parts, wired once.

:class:`Parts` holds the pool slot, the transfer engine, the lease table, metrics, limits, the
staging parts (rebuilt when an engine re-attaches) and the peer directory (set when the
service starts). :class:`kvxferd.daemon.core.Daemon` owns one and hands it to
:class:`~kvxferd.daemon.owner.Owner` and :class:`~kvxferd.daemon.reader.Reader`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from kvxferd.daemon.backlog import WATCH_BACKLOG
from kvxferd.daemon.peers import PeerDirectory
from kvxferd.daemon.slot import PoolSlot
from kvxferd.metrics import Metrics
from kvxferd.peers import PeerInfo
from kvxferd.pool import KVPool
from kvxferd.staging.setup import Staging
from kvxferd.tasks import start_now
from kvxferd.transfer import LeaseTable, TransferEngine


@dataclass(frozen=True)
class DaemonLimits:
    default_deadline_s: float = 30.0
    max_inflight: int = 256
    lease_ttl_s: float = 60.0
    max_block_ids: int = 1 << 20
    peer_timeout_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    max_deadline_s: float = 600.0  # the longest lease an owner grants (LeaseTable.max_ttl_s)
    transfer_mode: str = "pull"  # transfer.mode: "pull" (decode READs) or "push" (prefill WRITEs)
    watch_backlog: int = WATCH_BACKLOG  # server.watch_backlog (kvxferd/daemon/backlog.py)


@dataclass
class Parts:
    slot: PoolSlot
    engine: TransferEngine
    leases: LeaseTable
    metrics: Metrics
    limits: DaemonLimits
    agent_name: str
    staging: Staging | None = None
    peers: PeerDirectory | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def pool(self) -> KVPool:
        """The registered pool; raises EngineDetached while an attached daemon has none."""
        return self.slot.current()

    @property
    def info(self) -> PeerInfo:
        return self.slot.served().info

    def spawn(self, coro: Coroutine[Any, Any, None], *, now: bool = False) -> None:
        """Run ``coro`` in the background for the daemon's life (cancelled at close);
        ``now``: its first step runs before this returns where Python allows
        (:func:`kvxferd.tasks.start_now`)."""
        task = start_now(coro) if now else asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


Spawn = Callable[[Coroutine[Any, Any, None]], None]
