"""A real decode daemon (in-process: NIXL agent, transfer engine, gRPC server) against an owner
that serves its pool with KERNEL only (engine-attached IMPORTED VRAM, issue 13), on CPU.

Such an owner cannot be made for real without a GPU, so its control plane is scripted
(``tests/service/test_reader_fake_owner.py``'s FakeOwner: its NIXL metadata is a real agent's,
in a separate process) and advertises ``kernel_only_reason`` with its CUDA IPC export. This
daemon's pool is in host memory, so it cannot pull with KERNEL: StartPull must fail with
FAILED_PRECONDITION naming the reason and the fix, before any transfer exists, leaving no lease
share behind, and the connect-time transport probe must not READ the unregistered regions.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np
import pytest
from grpc import aio

from kvxferd.daemon.handshake import SelfDescription
from kvxferd.daemon.pulls import PullRequest, PullState
from kvxferd.ipc.host import host_id
from kvxferd.ipc.publish import KERNEL_ONLY, IpcPool, IpcRegion
from kvxferd.layout import preset
from kvxferd.layout.spec import MemoryType
from kvxferd.peers import PeerInfo
from kvxferd.scenario.owner import OwnerProcess
from kvxferd.service.app import Running
from kvxferd.v1 import peer_pb2, scheduler_pb2, scheduler_pb2_grpc, spec_pb2
from kvxferd.wire.codec import group_ids_to_proto
from tests.ipc.fakes import UUID, handle
from tests.service.test_reader_fake_owner import (
    ADDRESS,
    REGION,
    SPEC,
    FakeOwner,
    _decode,
    owner,  # noqa: F401  (the fixture: the owner's memory, a real NIXL agent)
)


class KernelOnlyOwner(FakeOwner):
    """A same-host owner whose VRAM pool is served by KERNEL only."""

    def envelope(self) -> tuple[int, bytes, bytes]:
        spec = preset(SPEC).with_memory(MemoryType.VRAM)
        regs = tuple(
            spec_pb2.RegionRegistration(
                region_name=r.name,
                base_address=int(self.memory.regions[i, 0]),
                device_id=0,
                nbytes=REGION,
            )
            for i, r in enumerate(spec.regions)
        )
        ipc = IpcPool(
            tuple(IpcRegion(handle("engine"), i * REGION, REGION, UUID) for i in range(len(regs))),
            kernel_only=KERNEL_ONLY,
        )
        return SelfDescription(
            info=PeerInfo(spec=spec, tp_rank=0, tp_size=1, prefix_caching=False),
            agent_name=self.memory.name,
            agent_metadata=self.memory.metadata,
            registrations=regs,
            generation=1,
            daemon_id="kernel-only-owner",
            instance_id=self.instance,
            address=ADDRESS,
            host_id=host_id(),
            ipc=ipc,
        ).envelope()


def test_a_reader_that_cannot_use_kernel_is_refused_at_start_pull(owner: OwnerProcess) -> None:  # noqa: F811
    async def confirm(req: peer_pb2.ConfirmLeaseRequest, n: int) -> Any:
        return fake.lease(req, [3, 9])

    fake = KernelOnlyOwner(owner, confirm)

    async def go() -> None:
        running: Running = await _decode(fake)
        try:
            async with aio.insecure_channel(running.grpc_address) as ch:
                stub = scheduler_pb2_grpc.SchedulerStub(ch)
                with pytest.raises(aio.AioRpcError) as ei:
                    await stub.StartPull(
                        scheduler_pb2.StartPullRequest(
                            transfer_id="kernel-only-1",
                            request_id="held-by-the-engine",
                            peer_address=ADDRESS,
                            remote_block_ids=group_ids_to_proto([[3, 9]]),
                            local_block_ids=group_ids_to_proto([[0, 5]]),
                            deadline_ms=10_000,
                        ),
                        timeout=20,
                    )
                assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                text = ei.value.details() or ""
                assert f"peer {ADDRESS} serves its pool with KERNEL pulls only" in text, text
                assert "0.5-0.6 GB/s" in text
                assert "this daemon's pool is in host memory" in text  # why not KERNEL here
                assert "mode='owned'" in text and "on the owner's host" in text  # the fixes
                # No transfer exists, and the probe did not READ the unregistered regions.
                assert running.daemon.reader.pulls.find("kernel-only-1") is None
                peers = await stub.ListPeers(scheduler_pb2.ListPeersRequest())
                (p,) = peers.peers
                assert p.read_transport == "unknown"
                assert "serves KERNEL pulls only" in p.read_transport_detail
            # The confirmation sent before planning is given back if the owner granted it.
            for _ in range(50):
                if "ConfirmLease" not in fake.calls or "ReleaseLease" in fake.calls:
                    break
                await asyncio.sleep(0.05)
            assert "ConfirmLease" not in fake.calls or "ReleaseLease" in fake.calls, fake.calls
        finally:
            await running.stop()

    asyncio.run(go())


class ReattachingOwner(KernelOnlyOwner):
    """An ordinary owner (host memory, registered with NIXL) whose engine re-attaches IMPORTED
    VRAM between the reader's handshake and its lease confirmation: the confirmation reports
    generation 2, and the handshake that follows describes a KERNEL-only pool."""

    def __init__(self, memory: OwnerProcess, confirm: Any) -> None:
        super().__init__(memory, confirm)
        self.reattached = False

    def envelope(self) -> tuple[int, bytes, bytes]:
        if not self.reattached:
            return FakeOwner.envelope(self)
        version, digest, payload = super().envelope()
        msg = peer_pb2.HandshakePayload.FromString(payload)
        msg.registration_generation = 2
        return version, digest, msg.SerializeToString()


def test_an_owner_turned_kernel_only_after_planning_fails_the_pull_without_a_read(
    owner: OwnerProcess,  # noqa: F811
) -> None:
    """The pull was planned DIRECT against a NIXL-served pool; the lease confirmation finds the
    owner re-attached as KERNEL-only. The READ must not be posted against the unregistered
    memory: the pull fails with the refusal's reason and fix."""

    async def confirm(req: peer_pb2.ConfirmLeaseRequest, n: int) -> Any:
        await asyncio.sleep(0.3)  # the reader plans DIRECT meanwhile
        fake.reattached = True
        resp = fake.lease(req, [3, 9])
        resp.lease.registration_generation = 2
        return resp

    fake = ReattachingOwner(owner, confirm)

    async def go() -> None:
        running: Running = await _decode(fake)
        try:
            req = PullRequest(
                transfer_id="reattached-1",
                request_id="held-by-the-engine",
                peer_address=ADDRESS,
                remote_ids=(np.array([3, 9], dtype=np.int64),),
                local_ids=(np.array([0, 5], dtype=np.int64),),
                deadline_s=10.0,
            )
            await running.daemon.reader.start_pull(req)
            rec = await asyncio.wait_for(
                running.daemon.reader.pulls.wait_terminal("reattached-1"), 20
            )
            assert rec.state is PullState.FAILED, rec
            text = str(rec.error)
            assert "serves its pool with KERNEL pulls only" in text, text
            assert "mode='owned'" in text  # the fix
            assert running.daemon.parts.engine.unreleased_handles == 0
        finally:
            await running.stop()

    asyncio.run(go())
