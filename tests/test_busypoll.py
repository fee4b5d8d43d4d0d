"""Busy polling (kvxferd/busypoll.py, docs/config.md ``server.busy_poll``): the loop is kept
polling only for a window after something arrived, never while idle; ``auto`` decides by the
CPUs the daemon may use; a real daemon started with it on serves pulls and says what it chose."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvxferd import busypoll
from kvxferd.busypoll import AUTO_MIN_CPUS, BusyPoll, quota_cpus, resolve
from kvxferd.config import load_config
from kvxferd.errors import ConfigError
from kvxferd.scenario.control_path import TINY, pool_blocks, pulling_pair, random_ids
from kvxferd.scenario.daemons import DaemonOptions


@pytest.mark.parametrize(
    ("mode", "cpus", "on"),
    [
        ("on", 1, True),
        ("off", 64, False),
        ("auto", AUTO_MIN_CPUS, True),
        ("auto", AUTO_MIN_CPUS - 1, False),
        ("auto", 1.5, False),
        ("auto", math.inf, True),
    ],
)
def test_resolve_says_why(mode: str, cpus: float, on: bool) -> None:
    got, why = resolve(mode, cpus)
    assert got is on
    assert why  # the start-up log line's reason
    if mode == "auto":
        assert f"{cpus:g} CPUs" in why


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("max 100000\n", math.inf),
        ("200000 100000\n", 2.0),
        ("50000 100000", 0.5),
        ("", math.inf),
        ("garbage here", math.inf),
        ("100 0", math.inf),
        ("-1 100000", math.inf),
    ],
)
def test_cgroup_quota(text: str, cpus: float) -> None:
    assert quota_cpus(text) == cpus


def _files(files: dict[str, str]) -> Callable[[str], str | None]:
    return files.get


@pytest.mark.parametrize(
    ("proc", "files", "cpus"),
    [
        # cgroup v2, a systemd unit with CPUQuota=150%: the unit's own cpu.max
        (
            "0::/system.slice/kvxferd.service\n",
            {
                "/sys/fs/cgroup/system.slice/kvxferd.service/cpu.max": "150000 100000\n",
                "/sys/fs/cgroup/system.slice/cpu.max": "max 100000\n",
            },
            1.5,
        ),
        # v2, the tighter quota is a parent's
        (
            "0::/kubepods/pod1/c1",
            {
                "/sys/fs/cgroup/kubepods/pod1/c1/cpu.max": "max 100000",
                "/sys/fs/cgroup/kubepods/pod1/cpu.max": "200000 100000",
                "/sys/fs/cgroup/kubepods/cpu.max": "1600000 100000",
            },
            2.0,
        ),
        # v2 in a container with its own namespace: "/" is the container's cgroup
        ("0::/\n", {"/sys/fs/cgroup/cpu.max": "800000 100000"}, 8.0),
        # v2, no quota anywhere
        ("0::/user.slice", {}, math.inf),
        # cgroup v1 (this repository's CI machine has it), a quota of 4 CPUs
        (
            "4:memory:/x\n1:cpu,cpuacct:/docker/abc\n0::/\n",
            {
                "/sys/fs/cgroup/cpu/docker/abc/cpu.cfs_quota_us": "400000\n",
                "/sys/fs/cgroup/cpu/docker/abc/cpu.cfs_period_us": "100000\n",
            },
            4.0,
        ),
        # v1, no quota (-1)
        (
            "1:cpu:/",
            {
                "/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1",
                "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000",
            },
            math.inf,
        ),
        ("", {}, math.inf),
        ("garbage\n", {}, math.inf),
    ],
)
def test_cgroup_cpus(proc: str, files: dict[str, str], cpus: float) -> None:
    assert busypoll.cgroup_cpus(proc, _files(files)) == cpus


def test_usable_cpus_is_at_most_the_affinity() -> None:
    import os

    assert 0 < busypoll.usable_cpus() <= len(os.sched_getaffinity(0))


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="> 0"):
        BusyPoll(0.0)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("server.busy_poll", "always", "auto, on, off"),
        ("server.busy_poll_window_ms", "0", "> 0"),
        ("server.busy_poll_window_ms", "5000", "<= 1000"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(key: str, value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as ei:
        load_config(None, env={}, overrides={key: value})
    assert ei.value.field == key


async def _until_idle(poll: BusyPoll) -> None:
    for _ in range(1000):
        if not poll.spinning:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("still polling after 5 s")


# Windows of a few tenths of a second, checked well inside or well past them: the timing holds
# on a loaded 2-core CI machine.


def test_idle_never_spins_and_a_touch_spins_for_one_window() -> None:
    async def main() -> None:
        poll = BusyPoll(0.3)
        poll.start()
        await asyncio.sleep(0.1)  # nothing arrived: the task waits, the loop sleeps
        assert poll.turns == 0 and not poll.spinning
        t0 = time.monotonic()
        poll.touch()
        await asyncio.sleep(0.01)
        assert poll.spinning
        assert poll.turns > 10  # the loop came back to the task at every turn
        await _until_idle(poll)
        assert time.monotonic() - t0 >= 0.3  # the whole window from the touch
        after = poll.turns
        await asyncio.sleep(0.1)
        assert poll.turns == after and not poll.spinning  # idle again: no more turns
        poll.stop()

    asyncio.run(main())


def test_touches_extend_the_window() -> None:
    async def main() -> None:
        poll = BusyPoll(0.5)
        poll.start()
        poll.touch()
        await asyncio.sleep(0.3)
        poll.touch()  # the window now ends 0.5 s from here, not from the first touch
        await asyncio.sleep(0.3)  # past the first touch's window
        assert poll.spinning
        poll.stop()
        await asyncio.sleep(0.01)
        assert not poll.spinning

    asyncio.run(main())


def test_module_touch_feeds_only_the_installed_one() -> None:
    async def main() -> None:
        poll = BusyPoll(0.02)
        poll.start()
        busypoll.touch()  # none installed: nothing happens
        await asyncio.sleep(0.01)
        assert poll.turns == 0
        old = busypoll.install(poll)
        try:
            busypoll.touch()
            await asyncio.sleep(0.01)
            assert poll.turns > 0
        finally:
            assert busypoll.install(old) is poll
            poll.stop()

    asyncio.run(main())


@pytest.mark.slow
def test_daemons_with_busy_polling_on_serve_pulls_and_say_so() -> None:
    """Both daemons spinning (``on``, whatever the CPUs): pulls on the scheduler socket end DONE
    with their bytes checked, and each daemon's log says busy polling is on and why."""
    on = ("--set", "server.busy_poll=on", "--set", "server.busy_poll_window_ms=2")
    opts = [
        DaemonOptions("prefill", TINY, extra=on),
        DaemonOptions("decode", TINY, extra=on, scheduler_socket=True),
    ]
    with pulling_pair(opts) as (ds, puller):
        rng, blocks = np.random.default_rng(3), pool_blocks(TINY)
        for seed in range(5):  # pull() raises unless DONE and released
            local, remote = random_ids(rng, blocks, 16), random_ids(rng, blocks, 16)
            puller.pull(local, remote, socket=True)
            assert puller.verify(local, remote, seed) == 0, "pulled blocks differ"
        for name in ("prefill", "decode"):
            lines = [
                json.loads(line)
                for line in ds[name].log_path.read_text().splitlines()
                if line.startswith("{") and '"busy polling"' in line
            ]
            assert lines, f"{name}: no 'busy polling' line in its log"
            why = "server.busy_poll = on; polling 2 ms"
            assert lines[0]["on"] is True and lines[0]["why"].startswith(why)


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace busypoll.touch with one that records which module called it."""
    import sys

    callers: list[str] = []
    monkeypatch.setattr(
        busypoll, "touch", lambda: callers.append(sys._getframe(1).f_globals["__name__"])
    )
    return callers


def test_every_frame_both_ways_touches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A framed call keeps both ends' loops polling: the server when its request arrives
    (kvxferd/service/local_calls.py), the caller when the answer does (kvxferd/wire/local.py)."""
    from prometheus_client import CollectorRegistry

    from kvxferd.metrics import Metrics
    from kvxferd.service.local_peer import LocalPeerServer
    from kvxferd.v1 import peer_pb2
    from kvxferd.wire.local import LocalTransport

    class Service:
        async def Heartbeat(self, request: object, context: object) -> object:  # noqa: N802
            return peer_pb2.HeartbeatResponse()

    callers = _recording(monkeypatch)

    async def main() -> None:
        server = LocalPeerServer(
            Service(), Metrics.create(CollectorRegistry()), str(tmp_path / "s")
        )
        await server.start()
        client = LocalTransport(server.path)
        await client("Heartbeat", peer_pb2.HeartbeatRequest(), timeout=5, metadata=())
        await server.close()

    asyncio.run(main())
    assert "kvxferd.service.local_calls" in callers
    assert "kvxferd.wire.local" in callers


def test_every_grpc_call_touches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gRPC call keeps the server's loop polling (kvxferd/service/decode_guard.py)."""
    from grpc import aio
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from kvxferd.service.decode_guard import DecodeGuard

    callers = _recording(monkeypatch)

    async def main() -> None:
        server = aio.server(interceptors=[DecodeGuard()])
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        await server.stop(None)

    asyncio.run(main())
    assert callers.count("kvxferd.service.decode_guard") == 1


def test_metrics_say_whether_it_polls_and_for_how_long() -> None:
    """``kvxferd_busy_poll`` is 1 while a poll is installed, ``kvxferd_busy_poll_seconds_total``
    grows by the seconds spent polling and stays once the loop sleeps (docs/operations.md)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvxferd.metrics import LiveState, Metrics

    registry = CollectorRegistry()
    m = Metrics.create(registry, process=False)
    m.add_live(LiveState)

    def sample(name: str) -> float:
        for line in generate_latest(registry).decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not served")

    assert sample("kvxferd_busy_poll") == 0 and sample("kvxferd_busy_poll_seconds_total") == 0

    async def main() -> None:
        poll = BusyPoll(0.3)
        old = busypoll.install(poll)
        poll.start()
        try:
            assert sample("kvxferd_busy_poll") == 1
            assert sample("kvxferd_busy_poll_seconds_total") == 0  # idle: never polled
            poll.touch()
            await asyncio.sleep(0.02)
            assert poll.spinning and sample("kvxferd_busy_poll_seconds_total") > 0
            await _until_idle(poll)
            done = sample("kvxferd_busy_poll_seconds_total")
            assert 0.25 <= done < 3  # one window (from the task's wake-up, after the touch)
            await asyncio.sleep(0.05)
            assert sample("kvxferd_busy_poll_seconds_total") == done  # asleep: no more
        finally:
            poll.stop()
            busypoll.install(old)

    asyncio.run(main())
