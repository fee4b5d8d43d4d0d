"""Busy polling: the event loop keeps polling its sockets for a short window after each call
arrives, instead of blocking in ``epoll_wait`` between them.

A pull is a chain of short hops between processes (the scheduler's StartPull, the lease
confirmation to the owner and its answer, the answer back): each lands on a thread that is
asleep in ``epoll_wait`` unless something keeps it awake, and on a virtualised GPU host waking
a sleeping thread costs about 0.1 ms per hop (docs/benchmarks.md, "Session 24": a 16-block
KERNEL pull 1.11 -> 0.77-0.97 ms with both daemons' loops never sleeping, the socket's bare
round trip 0.30 -> 0.19 ms). :class:`BusyPoll` buys most of that back for the time the daemon
is busy: every frame or RPC that arrives (:func:`touch`) keeps the loop polling with a zero
timeout for ``window_s`` more, by a task that yields at every loop turn; once nothing has
arrived for a whole window the task waits on an event and the loop sleeps as before. So an
idle daemon costs what it did, and a busy one at most one core while it is busy.

Whether to spin is the operator's (``server.busy_poll``; docs/config.md): ``auto`` spins where
the daemon may use at least :data:`AUTO_MIN_CPUS` CPUs (its affinity, and the cgroup's CPU
quota: under a quota of one or two CPUs, a spinning loop would be throttled, which costs far
more than a wake-up), ``on`` always, ``off`` never.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

AUTO_MIN_CPUS = 8
"""``server.busy_poll = "auto"`` spins where the daemon may use at least this many CPUs."""

_now = time.monotonic


class BusyPoll:
    """Keeps the running loop polling for ``window_s`` after the last :meth:`touch`."""

    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"the busy-poll window must be > 0 s, got {window_s}")
        self.window_s = window_s
        self._until = 0.0  # monotonic: spin until then
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.spinning = False  # the loop is being kept polling now (touched within the window)
        self._since = 0.0  # monotonic: when the current polling began
        self._polled_s = 0.0  # seconds spent polling before it
        self.turns = 0  # loop turns spent polling

    @property
    def polled_s(self) -> float:
        """Seconds the loop has spent polling instead of sleeping, the current stretch
        included (read by /metrics from its own thread: two float reads)."""
        since = self._since
        return self._polled_s + (_now() - since if self.spinning else 0.0)

    def touch(self) -> None:
        """Something arrived: keep polling for a window from now (cheap: called per frame)."""
        self._until = _now() + self.window_s
        wake = self._wake
        if wake is not None and not self.spinning and not wake.is_set():
            wake.set()

    def start(self) -> None:
        """Start the polling task on the running loop (once)."""
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(self._wake))

    def stop(self) -> None:
        """Stop the polling task: the loop sleeps between events again."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._wake = None

    async def _run(self, wake: asyncio.Event) -> None:
        sleep = asyncio.sleep
        while True:
            await wake.wait()  # the loop sleeps until a touch
            wake.clear()
            # One yield per loop turn: while this task is ready, the loop polls its sockets
            # with a zero timeout and runs whatever arrived before coming back here.
            self._since = _now()
            self.spinning = True
            try:
                while _now() < self._until:
                    self.turns += 1
                    await sleep(0)
            finally:
                self.spinning = False
                self._polled_s += _now() - self._since


_active: BusyPoll | None = None


def touch() -> None:
    """Keep this process's loop polling, if busy polling is on (a no-op otherwise)."""
    poll = _active
    if poll is not None:
        poll.touch()


def active() -> BusyPoll | None:
    """The busy polling :func:`touch` feeds, if it is on."""
    return _active


def install(poll: BusyPoll | None) -> BusyPoll | None:
    """Make ``poll`` the one :func:`touch` feeds (None: off); returns the one it replaces."""
    global _active
    old, _active = _active, poll
    return old


def quota_cpus(cpu_max: str) -> float:
    """The CPUs a cgroup quota allows, from ``"QUOTA PERIOD"`` (cgroup v2's ``cpu.max``; v1's
    two files joined): ``max`` (v2) or a negative quota (v1's -1) is no limit, inf."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return math.inf
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return math.inf
    return quota / period if period > 0 and quota > 0 else math.inf


def _ancestors(path: str) -> list[str]:
    """``/a/b`` -> ``["/a/b", "/a", "/"]``: a cgroup and every cgroup above it."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def cgroup_cpus(proc_cgroup: str, read: Callable[[str], str | None] = _read) -> float:
    """The CPUs this process's cgroups allow (``/proc/self/cgroup``'s text; inf: no quota): the
    smallest quota of its cgroup and those above it, cgroup v2 (``cpu.max``) or v1 (the ``cpu``
    controller's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``). In a container with its own
    cgroup namespace the paths are ``/``, which is the container's."""
    out = math.inf
    for line in proc_cgroup.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not hier or not path.startswith("/"):
            continue
        if hier == "0" and controllers == "":  # cgroup v2
            for cg in _ancestors(path):
                text = read(f"/sys/fs/cgroup{cg.rstrip('/')}/cpu.max")
                if text is not None:
                    out = min(out, quota_cpus(text))
        elif "cpu" in controllers.split(","):  # cgroup v1
            for cg in _ancestors(path):
                base = f"/sys/fs/cgroup/cpu{cg.rstrip('/')}"
                quota, period = read(f"{base}/cpu.cfs_quota_us"), read(f"{base}/cpu.cfs_period_us")
                if quota is not None and period is not None:
                    out = min(out, quota_cpus(f"{quota.strip()} {period.strip()}"))
    return out


def usable_cpus() -> float:
    """CPUs this process may run on: its affinity, capped by its cgroups' CPU quota if any."""
    try:
        n: float = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return min(n, cgroup_cpus(_read("/proc/self/cgroup") or ""))


def resolve(mode: str, cpus: float) -> tuple[bool, str]:
    """Whether to spin for ``server.busy_poll = mode`` on ``cpus`` usable CPUs, and why."""
    if mode == "on":
        return True, "server.busy_poll = on"
    if mode == "off":
        return False, "server.busy_poll = off"
    if cpus >= AUTO_MIN_CPUS:
        return True, f"{cpus:g} CPUs usable, auto spins from {AUTO_MIN_CPUS}"
    return False, f"only {cpus:g} CPUs usable, auto spins from {AUTO_MIN_CPUS}"


@contextlib.contextmanager
def polling(mode: str, window_ms: float) -> Iterator[BusyPoll | None]:
    """Busy polling as ``server.busy_poll`` asks, installed and started on the running loop for
    the block (None when off); logged with why."""
    on, why = resolve(mode, usable_cpus())
    poll = None
    if on:
        poll = BusyPoll(window_ms / 1e3)
        install(poll)
        poll.start()
        why = f"{why}; polling {window_ms:g} ms after each call arrives"
    # The fields as kvxferd.logs.kv gives them (that module is on this one's floor).
    log.info("busy polling", extra={"kv": {"on": on, "why": why}})
    try:
        yield poll
    finally:
        if poll is not None:
            poll.stop()
            if _active is poll:
                install(None)


__all__ = [
    "AUTO_MIN_CPUS",
    "BusyPoll",
    "active",
    "cgroup_cpus",
    "install",
    "polling",
    "quota_cpus",
    "resolve",
    "touch",
    "usable_cpus",
]
