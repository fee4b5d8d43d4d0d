"""The asyncio Scheduler client (``grpc.aio`` channels): the blocking client's API, awaited."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from types import TracebackType
from typing import Any, Self

import grpc
from grpc import aio

from kvxferd.client.errors import KvxferdRpcError
from kvxferd.client.requests import BlockIds, channel_options, metadata, start_request
from kvxferd.client.values import (
    ChecksumAlgorithm,
    Declined,
    PeerStatus,
    StartedPull,
    TransferStatus,
)
from kvxferd.v1 import scheduler_pb2, scheduler_pb2_grpc
from kvxferd.wire.peer_client import RpcFailure
from kvxferd.wire.scheduler_socket import AsyncSchedulerSocket

# What a failed call raises: grpc.aio's error, or on the scheduler socket RpcFailure.
_FAILED = (aio.AioRpcError, RpcFailure)


class AsyncSchedulerClient:
    """:class:`SchedulerClient` for asyncio (``grpc.aio``); create it inside the loop.
    ``socket``: as for :class:`SchedulerClient`, the unary calls on the daemon's scheduler
    socket (concurrent calls share one connection)."""

    def __init__(
        self,
        target: str,
        *,
        token: str = "",
        credentials: grpc.ChannelCredentials | None = None,
        timeout_s: float = 30.0,
        retry: bool = True,
        options: Sequence[tuple[str, Any]] = (),
        socket: str = "",
    ) -> None:
        opts = channel_options(retry, options)
        self._channel = (
            aio.secure_channel(target, credentials, options=opts)
            if credentials is not None
            else aio.insecure_channel(target, options=opts)
        )
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._socket = AsyncSchedulerSocket(socket) if socket else None
        self._unary: Any = self._socket or self._stub
        self._md = metadata(token)
        self.timeout_s = timeout_s

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close(None)
        if self._socket is not None:
            await self._socket.close()

    async def start_pull(
        self,
        *,
        request_id: str,
        peer_address: str,
        remote_block_ids: BlockIds,
        local_block_ids: BlockIds,
        transfer_id: str = "",
        deadline_ms: int = 0,
        skip_notify: bool = False,
    ) -> StartedPull:
        req = start_request(
            request_id=request_id,
            peer_address=peer_address,
            remote_block_ids=remote_block_ids,
            local_block_ids=local_block_ids,
            transfer_id=transfer_id,
            deadline_ms=deadline_ms,
            skip_notify=skip_notify,
        )
        try:
            resp = await self._unary.StartPull(req, timeout=self.timeout_s, metadata=self._md)
        except _FAILED as exc:
            raise KvxferdRpcError.wrap("StartPull", exc) from exc
        return StartedPull(TransferStatus.from_proto(resp.status), resp.created)

    async def pull(
        self,
        *,
        request_id: str,
        peer_address: str,
        remote_block_ids: BlockIds,
        local_block_ids: BlockIds,
        transfer_id: str = "",
        deadline_ms: int = 0,
        skip_notify: bool = False,
        timeout_s: float = 60.0,
    ) -> TransferStatus:
        """Start a pull and return its terminal status, in one call (StartPull with ``wait``:
        no WatchTransfers). A failed pull is returned, not raised: check ``state`` and
        ``error``. TimeoutError if it is not terminal in ``timeout_s`` (it goes on running; find
        it with :meth:`get_transfer` by the ``transfer_id`` you passed)."""
        req = start_request(
            request_id=request_id,
            peer_address=peer_address,
            remote_block_ids=remote_block_ids,
            local_block_ids=local_block_ids,
            transfer_id=transfer_id,
            deadline_ms=deadline_ms,
            skip_notify=skip_notify,
            wait=True,
        )
        try:
            resp = await self._unary.StartPull(req, timeout=timeout_s, metadata=self._md)
        except _FAILED as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(f"{req.transfer_id} not terminal after {timeout_s} s") from exc
            raise KvxferdRpcError.wrap("StartPull", exc) from exc
        return TransferStatus.from_proto(resp.status)

    async def get_transfer(self, transfer_id: str) -> TransferStatus:
        try:
            resp = await self._unary.GetTransfer(
                scheduler_pb2.GetTransferRequest(transfer_id=transfer_id),
                timeout=self.timeout_s,
                metadata=self._md,
            )
        except _FAILED as exc:
            raise KvxferdRpcError.wrap("GetTransfer", exc) from exc
        return TransferStatus.from_proto(resp.status)

    async def cancel_transfer(self, transfer_id: str) -> TransferStatus:
        try:
            resp = await self._unary.CancelTransfer(
                scheduler_pb2.CancelTransferRequest(transfer_id=transfer_id),
                timeout=self.timeout_s,
                metadata=self._md,
            )
        except _FAILED as exc:
            raise KvxferdRpcError.wrap("CancelTransfer", exc) from exc
        return TransferStatus.from_proto(resp.status)

    async def decline_pull(
        self, *, request_id: str, peer_address: str, deadline_ms: int = 0
    ) -> Declined:
        """Tell the prefill daemon at ``peer_address`` that this daemon will not pull
        ``request_id`` after all (its decode request ended before the pull): the prefill side
        frees the held blocks once no other expected reader is left, not at the lease's TTL.
        Refused while a pull of this daemon reads the request (cancel it instead)."""
        try:
            resp = await self._unary.DeclinePull(
                scheduler_pb2.DeclinePullRequest(
                    request_id=request_id, peer_address=peer_address, deadline_ms=deadline_ms
                ),
                timeout=self.timeout_s + deadline_ms / 1000,
                metadata=self._md,
            )
        except _FAILED as exc:
            raise KvxferdRpcError.wrap("DeclinePull", exc) from exc
        return Declined.from_proto(resp)

    async def watch_transfers(
        self, transfer_ids: Iterable[str] = ()
    ) -> AsyncIterator[TransferStatus]:
        call = self._stub.WatchTransfers(
            scheduler_pb2.WatchTransfersRequest(transfer_ids=list(transfer_ids)),
            metadata=self._md,
        )
        try:
            async for msg in call:
                yield TransferStatus.from_proto(msg.status)
        except _FAILED as exc:
            raise KvxferdRpcError.wrap("WatchTransfers", exc) from exc
        finally:
            call.cancel()

    async def wait(self, transfer_id: str, timeout_s: float = 60.0) -> TransferStatus:
        call = self._stub.WatchTransfers(
            scheduler_pb2.WatchTransfersRequest(transfer_ids=[transfer_id]),
            metadata=self._md,
            timeout=timeout_s,
        )
        try:
            async for msg in call:
                status = TransferStatus.from_proto(msg.status)
                if status.terminal:
                    return status
        except _FAILED as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(f"{transfer_id} not terminal after {timeout_s} s") from exc
            raise KvxferdRpcError.wrap("WatchTransfers", exc) from exc
        finally:
            call.cancel()
        return await self.get_transfer(transfer_id)

    async def list_peers(self) -> list[PeerStatus]:
        try:
            resp = await self._unary.ListPeers(
                scheduler_pb2.ListPeersRequest(), timeout=self.timeout_s, metadata=self._md
            )
        except _FAILED as exc:
            raise KvxferdRpcError.wrap("ListPeers", exc) from exc
        return [PeerStatus.from_proto(p) for p in resp.peers]

    async def checksum(
        self,
        group_index: int,
        block_ids: Sequence[int],
        *,
        kernel_block_ids: bool = False,
        algorithm: ChecksumAlgorithm = ChecksumAlgorithm.UNSPECIFIED,
    ) -> list[bytes]:
        try:
            resp = await self._stub.Checksum(
                scheduler_pb2.ChecksumRequest(
                    group_index=group_index,
                    block_ids=list(block_ids),
                    kernel_block_ids=kernel_block_ids,
                    algorithm=algorithm.value,  # type: ignore[arg-type]
                ),
                timeout=self.timeout_s,
                metadata=self._md,
            )
        except _FAILED as exc:
            raise KvxferdRpcError.wrap("Checksum", exc) from exc
        return list(resp.digests)


__all__ = ["AsyncSchedulerClient"]
