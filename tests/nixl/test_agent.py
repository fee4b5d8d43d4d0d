"""The NIXL adapter: typed errors, input checks, threading, notifications, idle CPU."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvxferd.errors import (
    Cancelled,
    InvalidRequest,
    PeerUnavailable,
    TransportError,
)
from kvxferd.nixl import AgentOptions, MemType, NixlAgent, ProgressMode, XferOp, XferState
from kvxferd.nixl._binding import bindings
from kvxferd.nixl.errors import map_nixl_error
from kvxferd.scenario.owner import OwnerProcess, OwnerSpec


@pytest.fixture(scope="module")
def agent() -> Iterator[NixlAgent]:
    a = NixlAgent(f"nixl-test-{os.getpid()}")
    a.start()
    yield a
    a.close()


@pytest.fixture(scope="module")
def owner() -> Iterator[OwnerProcess]:
    o = OwnerProcess(OwnerSpec(f"nixl-owner-{os.getpid()}", (1 << 16,)))
    yield o
    o.close()


def test_constructor_starts_nothing() -> None:
    a = NixlAgent("idle")
    assert not a.started
    with pytest.raises(TransportError, match="not started"):
        a.metadata()
    fut = a.register_async(np.array([[1, 1, 0]], dtype=np.int64), MemType.DRAM)
    with pytest.raises(TransportError, match="not running"):
        fut.result()


@pytest.mark.parametrize(
    ("exc_name", "kind"),
    [
        ("nixlRemoteDisconnectError", PeerUnavailable),
        ("nixlInvalidParamError", InvalidRequest),
        ("nixlNotFoundError", InvalidRequest),
        ("nixlNotAllowedError", TransportError),
        ("nixlCancelledError", Cancelled),
        ("nixlBackendError", TransportError),
    ],
)
def test_nixl_exceptions_map_to_kvxferd_errors(exc_name: str, kind: type) -> None:
    exc = getattr(bindings, exc_name)("boom")
    err = map_nixl_error(exc, op="post READ", peer="p1")
    assert type(err) is kind
    assert "p1" in str(err) and "fix:" in str(err)


@pytest.mark.parametrize(
    "regions",
    [
        np.zeros((0, 3), dtype=np.int64),
        np.array([[1, 2]], dtype=np.int64),
        np.array([[0, 16, 0]], dtype=np.int64),
        np.array([[1.5, 16, 0]]),
    ],
)
def test_register_rejects_malformed_regions(agent: NixlAgent, regions: np.ndarray) -> None:
    with pytest.raises(InvalidRequest):
        agent.register(regions, MemType.DRAM)


def test_register_and_deregister_one_entry_per_region(agent: NixlAgent) -> None:
    bufs = [torch.zeros(1 << 16, dtype=torch.uint8) for _ in range(3)]
    regions = np.array([[b.data_ptr(), b.numel(), 0] for b in bufs], dtype=np.int64)
    reg = agent.register(regions, MemType.DRAM)
    assert reg.nbytes == 3 << 16 and reg.regions.shape == (3, 3)
    agent.deregister(reg)
    with pytest.raises(InvalidRequest, match="already deregistered"):
        agent.deregister(reg)


def test_post_checks_inputs_before_nixl(agent: NixlAgent, owner: OwnerProcess) -> None:
    one = np.array([[0x1000, 16, 0]], dtype=np.int64)
    with pytest.raises(PeerUnavailable, match="not loaded"):
        agent.post(XferOp.READ, one, one, peer="nobody")
    with pytest.raises(InvalidRequest, match="lengths differ"):
        agent.post(XferOp.READ, one, np.array([[0x1000, 8, 0]], dtype=np.int64), peer="x")
    with pytest.raises(InvalidRequest):
        agent.post(XferOp.READ, one, np.vstack([one, one]), peer="x")


def test_restarted_peer_is_reloaded_and_wrong_name_refused(
    agent: NixlAgent, owner: OwnerProcess
) -> None:
    agent.add_remote(owner.name, owner.metadata)
    agent.add_remote(owner.name, owner.metadata)  # same name again: removed, then added
    assert agent.has_remote(owner.name)
    with pytest.raises(PeerUnavailable, match="expected"):
        agent.add_remote("someone-else", owner.metadata)


def test_read_poll_release_and_notifications(agent: NixlAgent, owner: OwnerProcess) -> None:
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    agent.register(np.array([[buf.data_ptr(), buf.numel(), 0]], dtype=np.int64), MemType.DRAM)
    agent.add_remote(owner.name, owner.metadata)
    owner.call("add_remote", agent.name, agent.metadata())
    local = np.array([[buf.data_ptr(), 4096, 0]], dtype=np.int64)
    remote = np.array([[int(owner.regions[0, 0]), 4096, 0]], dtype=np.int64)
    h = agent.post(XferOp.READ, local, remote, peer=owner.name)
    deadline = time.monotonic() + 10
    state = agent.poll(h)
    while state is XferState.IN_PROGRESS and time.monotonic() < deadline:
        time.sleep(0.001)
        state = agent.poll(h)
    assert state is XferState.DONE
    tel = agent.telemetry(h)
    assert tel is not None and tel.total_bytes == 4096 and tel.descriptors == 1
    assert agent.release(h) and h.released
    with pytest.raises(InvalidRequest, match="released"):
        agent.poll(h)
    assert buf[:4096].any()
    owner.call("notify", agent.name, b"hello")
    got: dict[str, list[bytes]] = {}
    while not got and time.monotonic() < deadline:
        got = agent.get_notifs()
        time.sleep(0.005)
    assert got == {owner.name: [b"hello"]}
    assert all(isinstance(k, str) for k in got)


def test_every_call_runs_on_the_one_nixl_thread(agent: NixlAgent) -> None:
    seen: set[int] = set()

    def poller() -> float | None:
        seen.add(threading.get_ident())
        return None

    agent.add_poller(poller)
    results: list[bytes] = []
    threads = [threading.Thread(target=lambda: results.append(agent.metadata())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    on = agent.submit(threading.get_ident).result()
    agent.remove_poller(poller)
    assert len(results) == 8 and len(set(results)) == 1
    assert seen == {on} and on != threading.get_ident()


def _idle_cpu(q: mp.Queue) -> None:  # type: ignore[type-arg]
    for mode in ProgressMode:
        agent = NixlAgent(f"idle-{mode.value}", options=AgentOptions(progress=mode))
        agent.start()
        buf = torch.zeros(1 << 16, dtype=torch.uint8)
        agent.register(np.array([[buf.data_ptr(), buf.numel(), 0]], dtype=np.int64), MemType.DRAM)
        time.sleep(0.1)
        t0, c0 = time.monotonic(), time.process_time()
        time.sleep(0.8)
        q.put((mode, (time.process_time() - c0) / (time.monotonic() - t0)))
        agent.close()


@pytest.mark.slow
def test_idle_agent_does_not_spin() -> None:
    # NIXL's Python default spins a core (progress delay 0); neither kvxferd mode may.
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_idle_cpu, args=(q,))
    p.start()
    shares = dict(q.get(timeout=60) for _ in ProgressMode)
    p.join(10)
    assert all(share < 0.25 for share in shares.values()), shares


@pytest.mark.gpu
def test_cuda_device_is_set_on_the_nixl_thread() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    a = NixlAgent("gpu-probe", cuda_device=0)
    a.start()
    try:
        assert a.submit(torch.cuda.current_device).result() == 0
    finally:
        a.close()
