"""The reader's pull lifecycle against an owner whose control plane is scripted in-process.

The decode daemon runs in this process (``kvxferd.service.app.start``: real NIXL agent, real
transfer engine, real gRPC server) with its Peer calls going to a ``FakeTransport``; the
owner's *memory* is real: a separate process (``kvxferd.scenario.owner``) whose NIXL agent
registered two pattern-filled regions, so a READ the reader posts moves real bytes. The fake
plays what a real owner cannot be made to do on cue: a ConfirmLease that hangs, refuses, names
blocks the request does not hold, or comes back from a restarted instance. Each test checks the
contract in docs/reliability.md: a pull that never posted lists no block; a refusal reaches
the status with the owner's words; a pull is DONE only with the bytes in place.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvxferd.config import load_config
from kvxferd.daemon.handshake import SelfDescription
from kvxferd.daemon.pulls import PullRecord, PullRequest, PullState
from kvxferd.errors import LeaseRefused
from kvxferd.layout import preset
from kvxferd.peers import PeerInfo
from kvxferd.scenario.owner import OwnerProcess, OwnerSpec
from kvxferd.scenario.pattern import pattern_words
from kvxferd.service.app import Running, start
from kvxferd.v1 import common_pb2, peer_pb2, spec_pb2
from kvxferd.wire.peer_client import FakeTransport, Metadata

# Two layers of 16 blocks x 64 KiB (bf16, 16 tokens, 8 heads, head size 128): 1 MiB each.
SPEC = "dense:num_layers=2,num_blocks=16,num_kv_heads=8,head_size=128,block_size=16"
BLOCK = 2 * 16 * 8 * 128 * 2
REGION = 16 * BLOCK
SEED = 7
ADDRESS = "owner.test:1"
_ids = itertools.count()

Confirm = Callable[[peer_pb2.ConfirmLeaseRequest, int], Awaitable[Any]]


@pytest.fixture(scope="module")
def owner() -> Iterator[OwnerProcess]:
    o = OwnerProcess(OwnerSpec(f"fake-owner-mem-{next(_ids)}", (REGION, REGION), seed=SEED))
    yield o
    o.close()


class FakeOwner:
    """The owner's control plane: Handshake as the owner process's memory, ConfirmLease as the
    test scripts it, Release and Heartbeat recorded."""

    def __init__(self, memory: OwnerProcess, confirm: Confirm) -> None:
        self.memory = memory
        self.confirm = confirm
        self.instance = "instance-1"
        self.local_socket = ""  # what the handshake advertises as the same-host Peer socket
        self.calls: list[str] = []
        self.confirms = 0

    def envelope(self) -> tuple[int, bytes, bytes]:
        spec = preset(SPEC)
        regs = tuple(
            spec_pb2.RegionRegistration(
                region_name=r.name,
                base_address=int(self.memory.regions[i, 0]),
                device_id=0,
                nbytes=REGION,
            )
            for i, r in enumerate(spec.regions)
        )
        return SelfDescription(
            info=PeerInfo(spec=spec, tp_rank=0, tp_size=1, prefix_caching=False),
            agent_name=self.memory.name,
            agent_metadata=self.memory.metadata,
            registrations=regs,
            generation=1,
            daemon_id="fake-owner",
            instance_id=self.instance,
            address=ADDRESS,
            local_socket=self.local_socket,
        ).envelope()

    async def __call__(self, method: str, request: Any, metadata: Metadata) -> Any:
        self.calls.append(method)
        if method == "Handshake":
            version, digest, payload = self.envelope()
            return peer_pb2.HandshakeResponse(
                protocol_version=version, compat_digest=digest, payload=payload, session=b"s" * 16
            )
        if method == "ConfirmLease":
            self.confirms += 1
            return await self.confirm(request, self.confirms)
        if method == "ReleaseLease":
            return peer_pb2.ReleaseLeaseResponse()
        if method == "Heartbeat":
            return peer_pb2.HeartbeatResponse(instance_id=self.instance, renewed_ms=5_000)
        raise AssertionError(f"unexpected call {method}")

    def lease(
        self, request: peer_pb2.ConfirmLeaseRequest, held: list[int]
    ) -> peer_pb2.ConfirmLeaseResponse:
        return peer_pb2.ConfirmLeaseResponse(
            lease=peer_pb2.Lease(
                request_id=request.request_id,
                state=peer_pb2.LEASE_STATE_ACTIVE,
                remaining_ms=30_000,
                block_ids=common_pb2.GroupBlockIds(groups=[common_pb2.BlockIds(ids=held)]),
                registration_generation=1,
            ),
            ticket=0x5EED,
            instance_id=self.instance,
        )


async def _decode(fake: FakeOwner, **extra: str) -> Running:
    cfg = load_config(
        env={},
        overrides={
            "server.listen": "127.0.0.1:0",
            "server.metrics_listen": "",
            "pool.preset": SPEC,
            **extra,
        },
    )
    return await start(cfg, peer_transport=lambda address: FakeTransport(fake))


async def _pull(
    running: Running, remote: list[int], local: list[int], *, deadline_s: float = 10.0
) -> PullRequest:
    req = PullRequest(
        transfer_id=f"t-{next(_ids)}",
        request_id=f"r-{next(_ids)}",
        peer_address=ADDRESS,
        remote_ids=(np.array(remote, dtype=np.int64),),
        local_ids=(np.array(local, dtype=np.int64),),
        deadline_s=deadline_s,
    )
    await running.daemon.reader.start_pull(req)
    return req


async def _end(running: Running, tid: str) -> PullRecord:
    return await asyncio.wait_for(running.daemon.reader.pulls.wait_terminal(tid), 20)


def _block_bytes(running: Running, region: int, block: int) -> np.ndarray:  # type: ignore[type-arg]
    pool = running.daemon.parts.slot.current()
    name = pool.spec.regions[region].name
    flat = pool.tensors[name].view(torch.uint8).reshape(-1)
    return flat[block * BLOCK : (block + 1) * BLOCK].numpy().view(np.int64).copy()


def _owner_words(region: int, block: int) -> np.ndarray:  # type: ignore[type-arg]
    return pattern_words(SEED, region, block * BLOCK // 8, BLOCK // 8)


def _run(fake: FakeOwner, body: Callable[[Running], Awaitable[None]], **extra: str) -> None:
    async def go() -> None:
        running = await _decode(fake, **extra)
        try:
            await body(running)
        finally:
            await running.stop()

    asyncio.run(go())


def test_confirmed_pull_reads_the_owner_bytes_and_says_it_read(owner: OwnerProcess) -> None:
    async def confirm(req: peer_pb2.ConfirmLeaseRequest, n: int) -> Any:
        return fake.lease(req, [3, 9])

    fake = FakeOwner(owner, confirm)

    async def body(running: Running) -> None:
        req = await _pull(running, [3, 9], [0, 5])
        rec = await _end(running, req.transfer_id)
        assert rec.state is PullState.DONE, rec.error
        for region in (0, 1):
            for remote, local in ((3, 0), (9, 5)):
                got = _block_bytes(running, region, local)
                assert np.array_equal(got, _owner_words(region, remote))
        assert rec.invalid_local_blocks == ()
        assert fake.calls[:2] == ["Handshake", "ConfirmLease"]

    _run(fake, body)


def test_cancel_while_the_owner_has_not_confirmed_lists_no_block(owner: OwnerProcess) -> None:
    release = asyncio.Event()

    async def confirm(req: peer_pb2.ConfirmLeaseRequest, n: int) -> Any:
        await release.wait()  # the owner is slow to answer
        return fake.lease(req, [1])

    fake = FakeOwner(owner, confirm)

    async def body(running: Running) -> None:
        before = _block_bytes(running, 0, 2)
        req = await _pull(running, [1], [2])
        await asyncio.sleep(0.2)
        rec = await running.daemon.reader.cancel(req.transfer_id)
        release.set()
        assert rec.state is PullState.CANCELLED
        assert rec.invalid_local_blocks == ()  # nothing was posted, nothing may have changed
        assert "before its READ was posted" in str(rec.error)
        assert np.array_equal(_block_bytes(running, 0, 2), before)

    _run(fake, body)


def test_owner_refusal_reaches_the_status_and_nothing_is_read(owner: OwnerProcess) -> None:
    async def confirm(req: peer_pb2.ConfirmLeaseRequest, n: int) -> Any:
        raise LeaseRefused(
            f"request {req.request_id!r} is not held", field="request_id", fix="hold it first"
        )

    fake = FakeOwner(owner, confirm)

    async def body(running: Running) -> None:
        before = _block_bytes(running, 1, 4)
        req = await _pull(running, [2], [4])
        rec = await _end(running, req.transfer_id)
        assert rec.state is PullState.FAILED
        assert isinstance(rec.error, LeaseRefused)
        assert "is not held" in str(rec.error)  # the owner's words, through the error trailer
        assert rec.invalid_local_blocks == ()
        assert np.array_equal(_block_bytes(running, 1, 4), before)

    _run(fake, body)


def test_a_lease_that_does_not_hold_the_blocks_is_refused_and_released(
    owner: OwnerProcess,
) -> None:
    async def confirm(req: peer_pb2.ConfirmLeaseRequest, n: int) -> Any:
        return fake.lease(req, [6])  # the scheduler asked for 6 and 7

    fake = FakeOwner(owner, confirm)

    async def body(running: Running) -> None:
        req = await _pull(running, [6, 7], [8, 9])
        rec = await _end(running, req.transfer_id)
        assert rec.state is PullState.FAILED
        assert "[7]" in str(rec.error) and "not held" in str(rec.error)
        for _ in range(50):  # the share is given back in the background
            if "ReleaseLease" in fake.calls:
                break
            await asyncio.sleep(0.05)
        assert "ReleaseLease" in fake.calls

    _run(fake, body)


def test_an_owner_that_restarted_is_handshaken_again_before_the_read(
    owner: OwnerProcess,
) -> None:
    async def confirm(req: peer_pb2.ConfirmLeaseRequest, n: int) -> Any:
        if n == 1:
            fake.instance = "instance-2"  # restarted since our handshake
            return peer_pb2.ConfirmLeaseResponse(instance_id="instance-2")
        return fake.lease(req, [11])

    fake = FakeOwner(owner, confirm)

    async def body(running: Running) -> None:
        req = await _pull(running, [11], [12])
        rec = await _end(running, req.transfer_id)
        assert rec.state is PullState.DONE, rec.error
        assert fake.calls[:4] == ["Handshake", "ConfirmLease", "Handshake", "ConfirmLease"]
        assert np.array_equal(_block_bytes(running, 0, 12), _owner_words(0, 11))

    _run(fake, body)


def test_an_owner_that_never_confirms_expires_the_pull(owner: OwnerProcess) -> None:
    # Each call outlasts the per-call cap (300 ms): asked again while the deadline allows, then
    # EXPIRED, saying the owner did not answer (not that it refused), with nothing listed.
    async def confirm(req: peer_pb2.ConfirmLeaseRequest, n: int) -> Any:
        await asyncio.sleep(60)

    fake = FakeOwner(owner, confirm)

    async def body(running: Running) -> None:
        req = await _pull(running, [5], [6], deadline_s=1.0)
        rec = await _end(running, req.transfer_id)
        assert rec.state is PullState.EXPIRED
        assert rec.invalid_local_blocks == ()  # nothing was posted
        assert rec.error is not None and "refused" not in rec.error.message
        assert 2 <= fake.confirms <= 4  # asked again while time was left, and no more

    _run(fake, body, **{"transfer.handshake_timeout_ms": "300"})


def test_a_confirmation_that_times_out_is_asked_again_within_the_deadline(
    owner: OwnerProcess,
) -> None:
    # The first ConfirmLease outlasts the per-call cap (a stalled owner); the owner renews a
    # share the reader already has, so the reader asks again and reads.
    async def confirm(req: peer_pb2.ConfirmLeaseRequest, n: int) -> Any:
        if n == 1:
            await asyncio.sleep(60)
        return fake.lease(req, [2])

    fake = FakeOwner(owner, confirm)

    async def body(running: Running) -> None:
        req = await _pull(running, [2], [7], deadline_s=10.0)
        rec = await _end(running, req.transfer_id)
        assert rec.state is PullState.DONE, rec.error
        assert fake.confirms == 2
        for region in (0, 1):
            assert np.array_equal(_block_bytes(running, region, 7), _owner_words(region, 2))

    _run(fake, body, **{"transfer.handshake_timeout_ms": "300"})


def test_an_advertised_socket_that_refuses_connections_leaves_the_calls_on_grpc(
    owner: OwnerProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The owner advertises a same-host Peer socket that exists here but accepts nothing (a
    dead daemon's, or another mount namespace's): the reader's check falls back to gRPC, the
    pull is confirmed over gRPC and reads the owner's bytes."""

    async def confirm(req: peer_pb2.ConfirmLeaseRequest, n: int) -> Any:
        return fake.lease(req, [4])

    fake = FakeOwner(owner, confirm)
    dead = tmp_path / "kvxferd-peer-dead.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(dead))
    fake.local_socket = str(dead)

    async def body(running: Running) -> None:
        req = await _pull(running, [4], [6])
        rec = await _end(running, req.transfer_id)
        assert rec.state is PullState.DONE, rec.error
        assert np.array_equal(_block_bytes(running, 0, 6), _owner_words(0, 4))
        assert fake.calls[:3] == ["Handshake", "Heartbeat", "ConfirmLease"]
        (link,) = running.peers.links()
        assert link.client.local is None
        done = [r for r in caplog.records if r.getMessage() == "handshake done"]
        assert [r.kv["peer_calls"] for r in done] == ["grpc"]  # type: ignore[attr-defined]

    caplog.set_level(logging.INFO, logger="kvxferd.daemon.peers")
    _run(fake, body)
