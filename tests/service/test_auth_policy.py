"""Real daemons: peers.allow, undecodable bodies, and text logs that callers cannot forge.

* A decode daemon whose ``peers.allow`` does not list the prefill's address refuses StartPull
  with PERMISSION_DENIED naming ``peers.allow`` (it never connects nor sends its token); one
  whose list covers it pulls as usual.
* A body that is not the method's protobuf message is INVALID_ARGUMENT naming the message type
  on every service (gRPC's own answer was UNKNOWN); a caller without the token gets
  UNAUTHENTICATED before its body is parsed.
* With ``log.format = text`` a request ID holding a newline or NUL is logged escaped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc import aio

from kvxferd.scenario.daemons import DaemonOptions
from kvxferd.v1 import scheduler_pb2
from tests.service.conftest import Daemon, launch
from tests.service.test_service_pull import Client

C = grpc.StatusCode
SMALL = ("--set", "transfer.staging_chunks=0")
GARBAGE = (
    b"\xff\xff\xff\xff\xff\xff",  # a tag whose varint never ends
    b"\x0a\x05ab",  # field 1, length 5, two bytes follow
)
NOT_UTF8 = b"\x12\x02\xc3\x28"  # StartPullRequest.request_id (string 2): not UTF-8


@dataclass
class Cluster:
    prefill: Daemon
    denied: Daemon
    allowed: Daemon
    tok: Daemon
    prefill_log: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    ds = launch(
        tmp_path_factory.mktemp("policy"),
        DaemonOptions(
            "prefill",
            "dense:num_blocks=16",
            fill_seed=5,
            extra=(*SMALL, "--log-format", "text"),
        ),
        DaemonOptions(
            "denied",
            "dense:num_blocks=16",
            extra=(*SMALL, "--set", "peers.allow=10.9.9.9, 127.0.0.2, localhost"),
        ),
        DaemonOptions(
            "allowed",
            "dense:num_blocks=16",
            extra=(*SMALL, "--set", "peers.allow=10.0.0.0/8,127.0.0.0/8"),
        ),
        DaemonOptions("tok", "dense:num_blocks=16", token="s3cret", extra=SMALL),
    )
    yield Cluster(ds["prefill"], ds["denied"], ds["allowed"], ds["tok"], ds.set["prefill"].log_path)
    ds.stop()


def test_pull_from_an_address_outside_peers_allow_is_permission_denied(cluster: Cluster) -> None:
    async def go() -> None:
        c = Client(cluster.prefill, cluster.denied)
        held = await c.hold("allow-denied", [1, 2])
        with pytest.raises(aio.AioRpcError) as ei:
            await c.pull(held, [3, 4])
        assert ei.value.code() == C.PERMISSION_DENIED, ei.value.details()
        details = ei.value.details() or ""
        assert "peers.allow" in details and held.peer_address in details, details
        peers = await c.decode.ListPeers(scheduler_pb2.ListPeersRequest())
        assert not [p for p in peers.peers if p.address == held.peer_address], peers

    asyncio.run(go())


def test_pull_from_an_address_inside_peers_allow_works(cluster: Cluster) -> None:
    async def go() -> None:
        c = Client(cluster.prefill, cluster.allowed)
        held = await c.hold("allow-ok", [5, 6, 7])
        st = await c.pull(held, [8, 9, 10])
        done = await c.wait(st.transfer_id)
        assert done.state == scheduler_pb2.TRANSFER_STATE_DONE, done.error.message
        assert await c.digests(c.decode, [8, 9, 10]) == await c.digests(c.prefill, [5, 6, 7])

    asyncio.run(go())


async def raw_unary(
    target: str, method: str, body: bytes, metadata: tuple[tuple[str, str], ...] = ()
) -> aio.AioRpcError:
    async with aio.insecure_channel(target) as channel:
        call = channel.unary_unary(method)  # bytes in, bytes out: nothing is serialized
        with pytest.raises(aio.AioRpcError) as ei:
            await call(body, metadata=metadata, timeout=10)
    return ei.value


async def raw_stream(target: str, method: str, body: bytes) -> aio.AioRpcError:
    async with aio.insecure_channel(target) as channel:
        call = channel.unary_stream(method)
        with pytest.raises(aio.AioRpcError) as ei:
            async for _ in call(body, timeout=10):
                pass
    return ei.value


@pytest.mark.parametrize("body", GARBAGE)
@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("/kvxferd.v1.Scheduler/StartPull", "kvxferd.v1.StartPullRequest"),
        ("/kvxferd.v1.Peer/Handshake", "kvxferd.v1.HandshakeRequest"),
        ("/kvxferd.v1.Peer/ConfirmLease", "kvxferd.v1.ConfirmLeaseRequest"),
        ("/grpc.health.v1.Health/Check", "grpc.health.v1.HealthCheckRequest"),
    ],
)
def test_undecodable_body_is_invalid_argument(
    cluster: Cluster, method: str, message: str, body: bytes
) -> None:
    err = asyncio.run(raw_unary(cluster.prefill.grpc, method, body))
    if err.code() is C.OK:  # pragma: no cover - a body that happened to decode
        pytest.fail(f"{body!r} decoded as {message}")
    assert err.code() == C.INVALID_ARGUMENT, (err.code(), err.details())
    assert message in (err.details() or ""), err.details()


def test_undecodable_body_of_streaming_and_engine_methods(cluster: Cluster) -> None:
    async def go() -> None:
        err = await raw_unary(cluster.prefill.grpc, "/kvxferd.v1.Scheduler/StartPull", NOT_UTF8)
        assert err.code() == C.INVALID_ARGUMENT, err.details()
        err = await raw_stream(
            cluster.prefill.grpc, "/kvxferd.v1.Scheduler/WatchTransfers", GARBAGE[0]
        )
        assert err.code() == C.INVALID_ARGUMENT, err.details()
        assert "kvxferd.v1.WatchTransfersRequest" in (err.details() or "")
        err = await raw_unary(
            f"unix:{cluster.prefill.engine_socket}", "/kvxferd.v1.Engine/Hold", GARBAGE[1]
        )
        assert err.code() == C.INVALID_ARGUMENT, err.details()
        assert "kvxferd.v1.HoldRequest" in (err.details() or "")

    asyncio.run(go())
    assert cluster.prefill.alive()  # type: ignore[operator]


def test_unauthenticated_garbage_is_refused_before_parsing(cluster: Cluster) -> None:
    async def go() -> None:
        method = "/kvxferd.v1.Scheduler/StartPull"
        err = await raw_unary(cluster.tok.grpc, method, GARBAGE[0])
        assert err.code() == C.UNAUTHENTICATED, err.details()
        bearer = (("authorization", "Bearer s3cret"),)
        err = await raw_unary(cluster.tok.grpc, method, GARBAGE[0], bearer)
        assert err.code() == C.INVALID_ARGUMENT, err.details()

    asyncio.run(go())


def test_text_log_escapes_control_characters_of_a_request_id(cluster: Cluster) -> None:
    rid = "inj\nINJECTED level=ERROR fake\x00end"

    async def go() -> None:
        await Client(cluster.prefill, cluster.allowed).hold(rid, [11])

    asyncio.run(go())
    deadline = time.monotonic() + 10
    while True:
        text = cluster.prefill_log.read_text(errors="replace")
        held = [line for line in text.splitlines() if "request held" in line and "inj" in line]
        if held or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert held, text[-2000:]
    assert 'request_id="inj\\nINJECTED level=ERROR fake\\x00end"' in held[0], held[0]
    assert not [line for line in text.splitlines() if line.startswith("INJECTED")]
    assert "\x00" not in text


def test_valid_calls_of_every_shape_pass_the_guard(cluster: Cluster) -> None:
    """Unary, server-streaming (health Watch writes through the context) and bidirectional
    streaming (reflection) calls still work behind the decode guard."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def go() -> None:
        async with aio.insecure_channel(cluster.prefill.grpc) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            ok = health_pb2.HealthCheckResponse.SERVING
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == ok
            watch = health.Watch(health_pb2.HealthCheckRequest())
            assert (await asyncio.wait_for(watch.read(), 10)).status == ok
            watch.cancel()

            async def ask() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            refl = reflection_pb2_grpc.ServerReflectionStub(channel)
            names = []
            async for resp in refl.ServerReflectionInfo(ask()):
                names = [s.name for s in resp.list_services_response.service]
            assert "kvxferd.v1.Scheduler" in names and "kvxferd.v1.Peer" in names, names

            stream = channel.stream_stream(
                "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
            )
            call = stream()
            await call.write(GARBAGE[0])
            await call.done_writing()
            with pytest.raises(aio.AioRpcError) as ei:
                async for _ in call:
                    pass
            assert ei.value.code() == C.INVALID_ARGUMENT, ei.value.details()
            assert "ServerReflectionRequest" in (ei.value.details() or "")

    asyncio.run(go())
