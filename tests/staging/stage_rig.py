"""Helpers for the Stage-stream tests: real daemons, a scheduler-side client, a raw reader.

The client holds on the prefill daemon (Engine.Hold), pulls on a decode daemon (StartPull,
WatchTransfers) and compares bytes with both daemons' Checksum. The raw reader is a handshaken
peer session (tests.service.raw_peer) that drives ``Peer.Stage`` by hand, as a hostile or
confused reader would. Daemon logs are JSON lines: :func:`log_lines` reads them.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from grpc import aio

from kvxferd.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    peer_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from kvxferd.wire.codec import group_ids_to_proto
from tests.service.conftest import Daemon
from tests.service.raw_peer import RawPeer

TERMINAL = {
    scheduler_pb2.TRANSFER_STATE_DONE,
    scheduler_pb2.TRANSFER_STATE_FAILED,
    scheduler_pb2.TRANSFER_STATE_CANCELLED,
    scheduler_pb2.TRANSFER_STATE_EXPIRED,
}


def staging(strategy: str, chunk_bytes: int, chunks: int) -> tuple[str, ...]:
    return (
        "--set",
        f"transfer.strategy={strategy}",
        "--set",
        f"transfer.staging_chunk_bytes={chunk_bytes}",
        "--set",
        f"transfer.staging_chunks={chunks}",
    )


class Client:
    def __init__(self, prefill: Daemon, decode: Daemon) -> None:
        self.engine = engine_pb2_grpc.EngineStub(
            aio.insecure_channel(f"unix:{prefill.engine_socket}")
        )
        self.prefill = scheduler_pb2_grpc.SchedulerStub(aio.insecure_channel(prefill.grpc))
        self.decode = scheduler_pb2_grpc.SchedulerStub(aio.insecure_channel(decode.grpc))

    async def hold(self, rid: str, groups: Sequence[Sequence[int]]) -> engine_pb2.HoldResponse:
        return await self.engine.Hold(
            engine_pb2.HoldRequest(request_id=rid, block_ids=group_ids_to_proto(list(groups)))
        )

    async def start(
        self, held: engine_pb2.HoldResponse, local: Sequence[Sequence[int]]
    ) -> scheduler_pb2.TransferStatus:
        resp = await self.decode.StartPull(
            scheduler_pb2.StartPullRequest(
                request_id=held.request_id,
                peer_address=held.peer_address,
                remote_block_ids=held.remote_block_ids,
                local_block_ids=group_ids_to_proto(list(local)),
            )
        )
        return resp.status

    async def pull(
        self, held: engine_pb2.HoldResponse, local: Sequence[Sequence[int]]
    ) -> scheduler_pb2.TransferStatus:
        return await self.wait((await self.start(held, local)).transfer_id)

    async def wait(self, tid: str) -> scheduler_pb2.TransferStatus:
        stream = self.decode.WatchTransfers(scheduler_pb2.WatchTransfersRequest(transfer_ids=[tid]))
        async for msg in stream:
            if msg.status.state in TERMINAL:
                stream.cancel()
                return msg.status
        raise AssertionError("watch ended without a terminal state")

    async def same(self, remote: Sequence[Sequence[int]], local: Sequence[Sequence[int]]) -> bool:
        for g, (r, lo) in enumerate(zip(remote, local, strict=True)):
            want = await self.prefill.Checksum(
                scheduler_pb2.ChecksumRequest(group_index=g, block_ids=list(r))
            )
            got = await self.decode.Checksum(
                scheduler_pb2.ChecksumRequest(group_index=g, block_ids=list(lo))
            )
            if list(want.digests) != list(got.digests):
                return False
        return True


def log_lines(path: Path, msg: str, **match: Any) -> list[dict[str, Any]]:
    """The JSON log lines of one daemon with this message whose fields equal ``match``."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        if rec.get("msg") == msg and all(rec.get(k) == v for k, v in match.items()):
            out.append(rec)
    return out


async def wait_log(path: Path, msg: str, timeout_s: float = 10.0, **match: Any) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not (found := log_lines(path, msg, **match)):
        assert loop.time() < end, f"no {msg!r} line matching {match} in {path}"
        await asyncio.sleep(0.02)
    return found[-1]


def granted_slots(daemon: Daemon) -> int:
    """The owner's staging slots granted to readers now (kvxferd_staging_slots)."""
    url = f"http://{daemon.metrics}/metrics"
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line.startswith('kvxferd_staging_slots{use="granted"}'):
            return int(float(line.split()[-1]))
    raise AssertionError("no kvxferd_staging_slots series")


class RawStage:
    """One ``Peer.Stage`` stream driven by hand: ``send`` queues a message, ``next`` reads one
    announcement (or raises the stream's error), ``close`` half-closes."""

    def __init__(self, peer: RawPeer, timeout_s: float = 20.0) -> None:
        self.queue: asyncio.Queue[peer_pb2.StageRequest | None] = asyncio.Queue()
        self.call = peer.stub.Stage(self._requests(), metadata=peer.md, timeout=timeout_s)
        self._events = self.call.__aiter__()

    async def _requests(self) -> AsyncIterator[peer_pb2.StageRequest]:
        while (msg := await self.queue.get()) is not None:
            yield msg

    def open(
        self,
        rid: str,
        groups: Sequence[Sequence[int]],
        *,
        chunk_bytes: int,
        chunks: int,
        credits: int,
    ) -> None:
        self.send(
            peer_pb2.StageRequest(
                open=peer_pb2.StageOpen(
                    request_id=rid,
                    reader_id="raw",
                    kernel_block_ids=common_pb2.GroupBlockIds(
                        groups=[common_pb2.BlockIds(ids=list(g)) for g in groups]
                    ),
                    chunk_bytes=chunk_bytes,
                    chunks=chunks,
                    credits=credits,
                )
            )
        )

    def send(self, msg: peer_pb2.StageRequest) -> None:
        self.queue.put_nowait(msg)

    def give_back(self, *slots: int) -> None:
        self.send(peer_pb2.StageRequest(read_slots=list(slots)))

    async def next(self, timeout_s: float = 10.0) -> peer_pb2.StageResponse:
        ev: peer_pb2.StageResponse = await asyncio.wait_for(self._events.__anext__(), timeout_s)
        return ev

    def close(self) -> None:
        self.queue.put_nowait(None)
