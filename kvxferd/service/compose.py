"""Config sections -> one :class:`~kvxferd.daemon.core.Daemon`: its limits, its staging
factory (with the cost model that picks DIRECT, STAGED or KERNEL) and its identity."""

from __future__ import annotations

import uuid

from kvxferd.config import Config
from kvxferd.daemon.core import Daemon, DaemonLimits
from kvxferd.daemon.slot import PoolSlot
from kvxferd.ipc.cma_link import CmaSide
from kvxferd.ipc.host import host_id
from kvxferd.ipc.publish import Publisher
from kvxferd.layout.spec import MemoryType
from kvxferd.metrics import Metrics
from kvxferd.nixl import MemType
from kvxferd.peers import PeerInfo
from kvxferd.service.memory import Memory
from kvxferd.staging.setup import IpcSide, StagingFactory
from kvxferd.staging.strategy import CostModel
from kvxferd.transfer import LeaseTable


def compose_daemon(
    cfg: Config, memory: Memory, leases: LeaseTable, metrics: Metrics, address: str
) -> Daemon:
    """The daemon over ``memory``, advertising ``address`` to its peers."""
    pool, agent, mem, ring, engine = (
        memory.pool,
        memory.agent,
        memory.mem,
        memory.ring,
        memory.engine,
    )
    metadata = agent.metadata()
    return Daemon(
        pool=PoolSlot.detached(metadata) if pool is None else pool,
        info=None
        if pool is None
        else PeerInfo(
            spec=pool.spec,
            tp_rank=cfg.pool.tp_rank,
            tp_size=cfg.pool.tp_size,
            prefix_caching=cfg.pool.prefix_caching,
        ),
        engine=engine,
        leases=leases,
        agent_name=agent.name,
        agent_metadata=metadata,
        address=address,
        metrics=metrics,
        limits=DaemonLimits(
            default_deadline_s=cfg.transfer.default_deadline_ms / 1000,
            max_inflight=cfg.transfer.max_inflight,
            lease_ttl_s=cfg.transfer.lease_ttl_ms / 1000,
            max_block_ids=cfg.transfer.max_block_ids,
            peer_timeout_s=cfg.transfer.handshake_timeout_ms / 1000,
            heartbeat_interval_s=cfg.peers.heartbeat_interval_ms / 1000,
            heartbeat_timeout_s=cfg.peers.heartbeat_timeout_ms / 1000,
            transfer_mode=cfg.transfer.mode,
            watch_backlog=cfg.server.watch_backlog,
        ),
        instance_id=cfg.server.instance_id or uuid.uuid4().hex,
        staging=StagingFactory(
            mode=cfg.transfer.strategy,
            model=CostModel.defaults(
                MemoryType.VRAM if mem is MemType.VRAM else MemoryType.DRAM
            ).with_overrides(
                descriptor_us=cfg.transfer.cost_descriptor_us,
                chunk_us=cfg.transfer.cost_chunk_us,
                link_gbps=cfg.transfer.cost_link_gbps,
                gather_gbps=cfg.transfer.cost_gather_gbps,
            ),
            ring=ring,
            engine=engine,
            leases=leases,
            grant_timeout_s=cfg.transfer.staging_grant_timeout_ms / 1000,
            max_block_ids=cfg.transfer.max_block_ids,
            ipc=IpcSide(
                enabled=cfg.transfer.cuda_ipc,
                host_id=host_id(),
                max_ctas=cfg.transfer.kernel_max_ctas,
                allow_slow_transport=cfg.transfer.allow_slow_transport,
                idle_s=2 * cfg.peers.heartbeat_timeout_ms / 1000,
                publisher=Publisher(enabled=cfg.transfer.cuda_ipc),
            ),
            cma=CmaSide(enabled=cfg.transfer.cma, threads=cfg.transfer.cma_threads),
        ),
    )


__all__ = ["compose_daemon"]
