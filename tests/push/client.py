"""A scheduler and engine client of two daemons for the push tests (bytes via Checksum)."""

from __future__ import annotations

from collections.abc import Sequence

from grpc import aio

from kvxferd.v1 import engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from kvxferd.wire.codec import group_ids_to_proto
from tests.service.conftest import Daemon

TERMINAL = {
    scheduler_pb2.TRANSFER_STATE_DONE,
    scheduler_pb2.TRANSFER_STATE_FAILED,
    scheduler_pb2.TRANSFER_STATE_CANCELLED,
    scheduler_pb2.TRANSFER_STATE_EXPIRED,
}
Groups = Sequence[Sequence[int]]


class Client:
    def __init__(self, prefill: Daemon, decode: Daemon) -> None:
        self.engine = engine_pb2_grpc.EngineStub(
            aio.insecure_channel(f"unix:{prefill.engine_socket}")
        )
        self.prefill = scheduler_pb2_grpc.SchedulerStub(aio.insecure_channel(prefill.grpc))
        self.decode = scheduler_pb2_grpc.SchedulerStub(aio.insecure_channel(decode.grpc))

    async def hold(self, rid: str, groups: Groups, ttl_ms: int = 0) -> engine_pb2.HoldResponse:
        return await self.engine.Hold(
            engine_pb2.HoldRequest(
                request_id=rid, block_ids=group_ids_to_proto(list(groups)), ttl_ms=ttl_ms
            )
        )

    async def start(
        self, held: engine_pb2.HoldResponse, local: Groups, **kw: object
    ) -> scheduler_pb2.TransferStatus:
        resp = await self.decode.StartPull(
            scheduler_pb2.StartPullRequest(
                request_id=held.request_id,
                peer_address=held.peer_address,
                remote_block_ids=held.remote_block_ids,
                local_block_ids=group_ids_to_proto(list(local)),
                **kw,  # type: ignore[arg-type]
            )
        )
        return resp.status

    async def wait(self, tid: str) -> scheduler_pb2.TransferStatus:
        stream = self.decode.WatchTransfers(scheduler_pb2.WatchTransfersRequest(transfer_ids=[tid]))
        async for msg in stream:
            if msg.status.state in TERMINAL:
                stream.cancel()
                return msg.status
        raise AssertionError("watch ended without a terminal state")

    async def pull(
        self, held: engine_pb2.HoldResponse, local: Groups
    ) -> scheduler_pb2.TransferStatus:
        return await self.wait((await self.start(held, local)).transfer_id)

    async def digests(
        self, stub: scheduler_pb2_grpc.SchedulerStub, group: int, ids: Sequence[int]
    ) -> list[bytes]:
        resp = await stub.Checksum(
            scheduler_pb2.ChecksumRequest(group_index=group, block_ids=list(ids))
        )
        return list(resp.digests)

    async def local_digests(self, local: Groups) -> list[list[bytes]]:
        return [await self.digests(self.decode, g, ids) for g, ids in enumerate(local)]

    async def same(self, remote: Groups, local: Groups) -> bool:
        """Every local logical block equals the remote one it was paired with."""
        for g, (r, lo) in enumerate(zip(remote, local, strict=True)):
            if await self.digests(self.decode, g, lo) != await self.digests(self.prefill, g, r):
                return False
        return True
