"""One kvxferd daemon: its parts, its owner role and its reader role, independent of gRPC.

:class:`Daemon` takes its parts (pool slot, transfer engine, lease table, metrics, staging)
and starts nothing; ``kvxferd.service.app`` wires and starts them. Servicers are thin: they
decode a request, call one method of :attr:`Daemon.owner` (holds, leases, peer sessions:
:mod:`kvxferd.daemon.owner`) or :attr:`Daemon.reader` (pulls: :mod:`kvxferd.daemon.reader`)
or of the daemon itself (what it says about itself, checksums, lifecycle), and encode the
answer. Every method runs on the event loop; NIXL work happens on the agent's thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import uuid
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvxferd.blocks import check_block_ids, expand_group
from kvxferd.daemon.owner import Owner
from kvxferd.daemon.parts import DaemonLimits, Parts
from kvxferd.daemon.peers import (
    LinkState,
    PeerDirectory,
    PeerLink,
    RemoteDescription,
    SelfDescription,
)
from kvxferd.daemon.pusher import Pusher
from kvxferd.daemon.reader import Reader
from kvxferd.daemon.slot import PoolSlot
from kvxferd.errors import InvalidRequest
from kvxferd.layout.spec import MemoryType
from kvxferd.metrics import Metrics
from kvxferd.nixl import MemType
from kvxferd.peers import PeerInfo
from kvxferd.pool import KVPool
from kvxferd.staging.setup import Staging, StagingFactory
from kvxferd.transfer import LeaseTable, TransferEngine
from kvxferd.v1 import spec_pb2

Int64Array = npt.NDArray[np.int64]


class Daemon:
    """One kvxferd daemon: :attr:`owner` (prefill side) and :attr:`reader` (decode side)."""

    def __init__(
        self,
        *,
        pool: KVPool | PoolSlot,
        info: PeerInfo | None,
        engine: TransferEngine,
        leases: LeaseTable,
        agent_name: str,
        agent_metadata: bytes,
        address: str,
        metrics: Metrics,
        limits: DaemonLimits,
        instance_id: str | None = None,
        staging: StagingFactory | None = None,
    ) -> None:
        if isinstance(pool, KVPool):
            if info is None:
                raise InvalidRequest("an owned pool needs its PeerInfo", field="info")
            pool = PoolSlot.owned(pool, info, agent_metadata)
        self.parts = Parts(pool, engine, leases, metrics, limits, agent_name)
        self._staging_factory = staging
        if staging is not None:
            self.parts.staging = staging.build(pool.current() if pool.registered else None)
        self.address = address
        self.instance_id = instance_id or uuid.uuid4().hex
        self.local_socket = ""  # set once the same-host Peer socket serves (service.app)
        self.scheduler_socket = ""  # set once server.scheduler_socket serves (service.app)
        self.daemon_id = agent_name
        self.owner = Owner(self.parts)
        self.reader = Reader(self.parts)
        self.pusher = Pusher(self.parts, self.owner, self.connect_remote)  # push mode, owner side

    # -- what the roles share ----------------------------------------------------------------

    @property
    def slot(self) -> PoolSlot:
        return self.parts.slot

    @property
    def engine(self) -> TransferEngine:
        return self.parts.engine

    @property
    def leases(self) -> LeaseTable:
        return self.parts.leases

    @property
    def metrics(self) -> Metrics:
        return self.parts.metrics

    @property
    def limits(self) -> DaemonLimits:
        return self.parts.limits

    @property
    def agent_name(self) -> str:
        return self.parts.agent_name

    @property
    def staging(self) -> Staging | None:
        return self.parts.staging

    @property
    def peers(self) -> PeerDirectory | None:
        return self.parts.peers

    @property
    def pool(self) -> KVPool:
        """The registered pool; raises EngineDetached while an attached daemon has none."""
        return self.parts.pool

    @property
    def info(self) -> PeerInfo:
        return self.parts.info

    @property
    def agent_metadata(self) -> bytes:
        return self.parts.slot.metadata

    @property
    def generation(self) -> int:
        return self.parts.slot.generation

    # -- the pool (fixed, or attached by an engine: kvxferd.daemon.slot) ---------------------

    def local_rows(self, pool_rows: Int64Array) -> Int64Array:
        """The transfer engine's local regions for a pool: its rows, then the staging ring's."""
        f = self._staging_factory
        return pool_rows if f is None else f.local_rows(pool_rows)

    def rebind_staging(self, pool: KVPool | None) -> Staging | None:
        """An engine attached ``pool`` (or detached: None): staging follows the pool. Returns
        the closed staging of the pool before (await its ``quiesce`` before dropping that)."""
        if self._staging_factory is None:
            return None
        old = self.parts.staging
        if old is not None:
            old.close()  # its owner side, and the KERNEL mappings of its pool
        self.parts.staging = self._staging_factory.build(pool)
        return old

    # -- wiring -------------------------------------------------------------------------------

    def attach_peers(self, peers: PeerDirectory) -> None:
        self.parts.peers = peers

    def observe_peer(self, link: PeerLink) -> None:
        """Metrics after a handshake attempt (PeerDirectory's callback)."""
        result = {LinkState.READY: "ok", LinkState.REFUSED: "refused"}.get(link.state, "failed")
        self.metrics.handshakes.labels("client", result).inc()

    def describe_self(self) -> SelfDescription:
        served = self.parts.slot.served()
        staging = self.parts.staging
        regs = tuple(
            spec_pb2.RegionRegistration(
                region_name=r.name, base_address=m.addr, device_id=m.device, nbytes=m.nbytes
            )
            for r, m in zip(served.pool.spec.regions, served.pool.memory, strict=True)
        )
        return SelfDescription(
            info=dataclasses.replace(served.info, transfer_mode=self.limits.transfer_mode),
            agent_name=self.agent_name,
            agent_metadata=self.agent_metadata,
            registrations=regs,
            generation=self.generation,
            daemon_id=self.daemon_id,
            instance_id=self.instance_id,
            address=self.address,
            staging=staging.info if staging else None,
            host_id=staging.ipc.host_id if staging else "",
            ipc=staging.ipc_export(served.pool, self.generation) if staging else None,
            local_socket=self.local_socket,
        )

    def connect_remote(self, remote: RemoteDescription) -> None:
        """Load a handshaken peer's NIXL metadata and regions (once per peer incarnation)."""
        mem = _mem_type(remote)
        regions = remote.regions
        staging = self.parts.staging
        if remote.staging is not None and staging and staging.info is not None:
            # The peer's ring is one more region, at the index our own ring has locally.
            regions = np.vstack([regions, np.array([remote.staging.row()], dtype=np.int64)])
        self.engine.connect_peer(remote.agent_name, remote.agent_metadata, regions, mem)

    def checksum(self, group: int, ids: Sequence[int], *, kernel: bool) -> list[bytes]:
        spec = self.pool.spec
        if not 0 <= group < len(spec.groups):
            raise InvalidRequest(
                f"group {group} does not exist; the spec has {len(spec.groups)}",
                field="group_index",
                fix=f"pass a group_index below {len(spec.groups)} (the KV cache groups of"
                " Describe's spec)",
            )
        g = spec.groups[group]
        if kernel or g.kind.is_state:
            arr = check_block_ids(
                ids, spec.num_kernel_blocks(group), "block_ids", max_ids=self.limits.max_block_ids
            )
            return self.pool.checksums(group, arr.tolist())
        arr = check_block_ids(
            ids, spec.num_logical_blocks(group), "block_ids", max_ids=self.limits.max_block_ids
        )
        digests = self.pool.checksums(group, expand_group(g, arr).tolist())
        return [
            hashlib.blake2b(b"".join(digests[i * g.ppl : (i + 1) * g.ppl]), digest_size=8).digest()
            for i in range(arr.size)
        ]

    # -- lifecycle ----------------------------------------------------------------------------

    async def close(self) -> None:
        self.reader.shares.stop()
        tasks = self.parts.tasks
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _mem_type(remote: RemoteDescription) -> MemType:
    mem = remote.info.spec.regions[0].memory
    return MemType.VRAM if mem is MemoryType.VRAM else MemType.DRAM


__all__ = ["Daemon", "DaemonLimits"]
