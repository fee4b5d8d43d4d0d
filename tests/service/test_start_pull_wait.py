"""StartPull with ``wait`` (scheduler.proto): one round trip per pull.

The decode daemon runs in this process with a real gRPC server and a real NIXL agent; the
owner's control plane is scripted (``tests/service/test_reader_fake_owner.py``'s FakeOwner) so a
confirmation can hang or be refused on cue, and its memory is a real process whose bytes a READ
moves. Each test asks what the proto's comment on ``wait`` promises:

* the answer carries the terminal status, stages included, and the bytes are in place;
* a FAILED pull is an OK answer whose status says why;
* a request error is a gRPC error at once, not a wait;
* a caller that goes away leaves the pull running, and the same request finds it again
  (created = false), its ``wait`` not part of the identity;
* a different request under the same transfer_id is still ALREADY_EXISTS.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import grpc
import numpy as np
from grpc import aio

from kvxferd.errors import LeaseRefused
from kvxferd.scenario.owner import OwnerProcess
from kvxferd.service.app import Running
from kvxferd.v1 import common_pb2, peer_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.service.test_reader_fake_owner import (
    ADDRESS,
    FakeOwner,
    _block_bytes,
    _owner_words,
    _run,
    owner,
)

__all__ = ["owner"]  # the module fixture, shared with the fake-owner tests
_ids = itertools.count()


def _request(remote: list[int], local: list[int], **kw: Any) -> scheduler_pb2.StartPullRequest:
    n = next(_ids)
    return scheduler_pb2.StartPullRequest(
        transfer_id=kw.pop("transfer_id", f"wait-t-{n}"),
        request_id=kw.pop("request_id", f"wait-r-{n}"),
        peer_address=ADDRESS,
        remote_block_ids=common_pb2.GroupBlockIds(groups=[common_pb2.BlockIds(ids=remote)]),
        local_block_ids=common_pb2.GroupBlockIds(groups=[common_pb2.BlockIds(ids=local)]),
        deadline_ms=kw.pop("deadline_ms", 10_000),
        **kw,
    )


def _stub(running: Running) -> tuple[aio.Channel, Any]:  # an asyncio SchedulerStub
    ch = aio.insecure_channel(running.grpc_address)
    return ch, scheduler_pb2_grpc.SchedulerStub(ch)


def test_wait_answers_with_the_terminal_status_and_the_bytes_are_in_place(
    owner: OwnerProcess,
) -> None:
    async def confirm(req: peer_pb2.ConfirmLeaseRequest, n: int) -> Any:
        return fake.lease(req, [3, 9])

    fake = FakeOwner(owner, confirm)

    async def body(running: Running) -> None:
        ch, stub = _stub(running)
        async with ch:
            resp = await stub.StartPull(_request([3, 9], [1, 6], wait=True), timeout=20)
        assert resp.created
        st = resp.status
        assert st.state == scheduler_pb2.TRANSFER_STATE_DONE, st.error
        assert st.finished_unix_ns > 0
        assert st.stages[0].name == "decode" and len(st.stages) >= 3
        for region in (0, 1):
            for remote, local in ((3, 1), (9, 6)):
                assert np.array_equal(
                    _block_bytes(running, region, local), _owner_words(region, remote)
                )

    _run(fake, body)


def test_a_failed_pull_is_an_ok_answer_that_says_why(owner: OwnerProcess) -> None:
    async def confirm(req: peer_pb2.ConfirmLeaseRequest, n: int) -> Any:
        raise LeaseRefused(
            f"request {req.request_id!r} is not held", field="request_id", fix="hold it first"
        )

    fake = FakeOwner(owner, confirm)

    async def body(running: Running) -> None:
        ch, stub = _stub(running)
        async with ch:
            resp = await stub.StartPull(_request([2], [4], wait=True), timeout=20)
        assert resp.status.state == scheduler_pb2.TRANSFER_STATE_FAILED
        assert "is not held" in resp.status.error.message  # the owner's words

    _run(fake, body)


def test_a_bad_request_is_an_error_at_once_not_a_wait(owner: OwnerProcess) -> None:
    async def confirm(req: peer_pb2.ConfirmLeaseRequest, n: int) -> Any:
        await asyncio.sleep(60)  # never reached: the request is refused before

    fake = FakeOwner(owner, confirm)

    async def body(running: Running) -> None:
        ch, stub = _stub(running)
        async with ch:
            t0 = time.monotonic()
            req = _request([1], [10_000], wait=True)
            try:
                await stub.StartPull(req, timeout=20)
            except aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()
                assert "10000" in (exc.details() or "")
            else:
                raise AssertionError("a local block ID outside the pool was accepted")
            assert time.monotonic() - t0 < 5
            try:  # and no pull was left behind
                await stub.GetTransfer(
                    scheduler_pb2.GetTransferRequest(transfer_id=req.transfer_id), timeout=5
                )
            except aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND
            else:
                raise AssertionError("a refused pull was recorded")

    _run(fake, body)


def test_a_caller_that_goes_away_leaves_the_pull_running_and_finds_it_again(
    owner: OwnerProcess,
) -> None:
    release = asyncio.Event()

    async def confirm(req: peer_pb2.ConfirmLeaseRequest, n: int) -> Any:
        await release.wait()  # the owner is slow to answer
        return fake.lease(req, [5])

    fake = FakeOwner(owner, confirm)

    async def body(running: Running) -> None:
        req = _request([5], [7], wait=True)
        ch, stub = _stub(running)
        async with ch:
            try:
                await stub.StartPull(req, timeout=0.5)
            except aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            else:
                raise AssertionError("answered before the owner confirmed")
            got = await stub.GetTransfer(
                scheduler_pb2.GetTransferRequest(transfer_id=req.transfer_id), timeout=5
            )
            assert got.status.state == scheduler_pb2.TRANSFER_STATE_CONFIRMING
            release.set()
            again = await stub.StartPull(req, timeout=20)  # a retry: the same request
            assert not again.created
            assert again.status.state == scheduler_pb2.TRANSFER_STATE_DONE, again.status.error
            assert np.array_equal(_block_bytes(running, 0, 7), _owner_words(0, 5))

    _run(fake, body)


def test_wait_is_not_part_of_the_identity_but_the_request_is(owner: OwnerProcess) -> None:
    async def confirm(req: peer_pb2.ConfirmLeaseRequest, n: int) -> Any:
        return fake.lease(req, [8])

    fake = FakeOwner(owner, confirm)

    async def body(running: Running) -> None:
        plain = _request([8], [11])
        ch, stub = _stub(running)
        async with ch:
            first = await stub.StartPull(plain, timeout=20)
            assert first.created
            waiting = scheduler_pb2.StartPullRequest()
            waiting.CopyFrom(plain)
            waiting.wait = True
            joined = await stub.StartPull(waiting, timeout=20)
            assert not joined.created
            assert joined.status.transfer_id == plain.transfer_id
            assert joined.status.state == scheduler_pb2.TRANSFER_STATE_DONE
            other = scheduler_pb2.StartPullRequest()
            other.CopyFrom(waiting)
            other.local_block_ids.groups[0].ids[0] = 12
            try:
                await stub.StartPull(other, timeout=20)
            except aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.ALREADY_EXISTS
            else:
                raise AssertionError("a different request reused a transfer_id")

    _run(fake, body)
