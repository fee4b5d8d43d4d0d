"""One timed pull through two real daemons, as a scheduler drives it: Hold on the prefill
daemon, StartPull on the decode daemon, the terminal status from one WatchTransfers stream, and
the release seen on WatchReleases before the blocks are held again. ``kvxferd bench`` and the
attached-pool benchmark time pulls with it; :meth:`DaemonPuller.verify` compares sampled blocks
of both pools by Checksum.
"""

from __future__ import annotations

import math
import secrets
import sys
import time
from dataclasses import dataclass

import numpy as np

from kvxferd.scenario.client import (
    TERMINAL,
    DaemonClient,
    ReleaseWatcher,
    TransferWatcher,
    state_name,
)
from kvxferd.scenario.mix import Int64Array
from kvxferd.v1 import scheduler_pb2

VERIFY_SAMPLES = 32
PULL_DEADLINE_MS = 600_000
WAIT_TIMEOUT_S = 900.0


class BenchFailure(Exception):
    """A transfer failed or a sampled block differs."""


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class PullOutcome:
    seconds: float  # StartPull call -> terminal status (on the stream, or StartPull's answer)
    status: scheduler_pb2.TransferStatus
    # The terminal status seen -> the prefill daemon's release of the request seen on its
    # WatchReleases stream: how long the owner holds the blocks after the pull ended.
    release_seconds: float = math.nan

    @property
    def server_seconds(self) -> float:
        return (self.status.finished_unix_ns - self.status.created_unix_ns) / 1e9

    @property
    def data_seconds(self) -> float:
        if not self.status.started_unix_ns:
            return math.nan
        return (self.status.finished_unix_ns - self.status.started_unix_ns) / 1e9


class DaemonPuller:
    """Hold on the prefill engine, StartPull on the decode daemon, wait on one stream (or, with
    ``wait``, for StartPull's answer: the terminal status in one round trip). The stream is
    opened for the first pull that waits on it and stays open until :meth:`watching` closes it:
    a caller that waits with StartPull watches nothing, and its daemon sends nothing more."""

    def __init__(self, prefill: DaemonClient, decode: DaemonClient) -> None:
        self.prefill = prefill
        self.decode = decode
        self.releases = ReleaseWatcher(prefill)
        self.tag = secrets.token_hex(3)
        self._n = 0
        self._watcher: TransferWatcher | None = None

    def watching(self, on: bool) -> None:
        """Open the WatchTransfers stream (registered when this returns), or close it."""
        if on and self._watcher is None:
            self._watcher = TransferWatcher(self.decode)
        elif not on and self._watcher is not None:
            self._watcher.close()
            self._watcher = None

    def close(self) -> None:
        self.watching(False)
        self.releases.close()

    def pull(
        self, local: Int64Array, remote: Int64Array, *, wait: bool = False, socket: bool = False
    ) -> PullOutcome:
        """One pull; ``wait``: StartPull with ``wait`` (over gRPC, or with ``socket`` on the
        decode daemon's scheduler socket), else StartPull and the status on the stream."""
        self._n += 1
        rid = f"bench-{self.tag}-{self._n}"
        hold = self.prefill.hold(rid, [remote])
        if wait or socket:
            t0 = time.perf_counter()
            st = self.decode.start_pull(
                f"{rid}-pull",
                hold,
                [local],
                deadline_ms=PULL_DEADLINE_MS,
                wait_s=WAIT_TIMEOUT_S,
                local=socket,
            ).status
            ended = time.perf_counter()
            seconds = ended - t0
        else:
            self.watching(True)
            assert self._watcher is not None
            watcher = self._watcher
            pending = watcher.expect(f"{rid}-pull")
            t0 = time.perf_counter()
            resp = self.decode.start_pull(
                pending.transfer_id, hold, [local], deadline_ms=PULL_DEADLINE_MS
            )
            if resp.status.state in TERMINAL:
                watcher.resolve(pending, resp.status, "StartPull")
            st = watcher.wait(pending, WAIT_TIMEOUT_S)
            ended = pending.terminal_at
            seconds = ended - t0
        if st.state != scheduler_pb2.TRANSFER_STATE_DONE:
            why = st.error.message if st.HasField("error") else "no error detail"
            raise BenchFailure(f"pull {rid} ended {state_name(st.state)}: {why}")
        # Not timed: let the prefill daemon release the blocks before they are held again.
        if self.releases.wait([rid], 10.0) and not self.releases.error:
            raise BenchFailure(f"the prefill daemon did not release {rid} within 10s")
        released = self.releases.released_at.get(rid, math.nan) - ended
        return PullOutcome(seconds, st, released)

    def verify(self, local: Int64Array, remote: Int64Array, seed: int) -> int:
        rng = np.random.default_rng(seed)
        pick = rng.choice(local.size, size=min(VERIFY_SAMPLES, local.size), replace=False)
        mine = self.decode.checksum(0, local[pick])
        theirs = self.prefill.checksum(0, remote[pick])
        return sum(1 for a, b in zip(mine, theirs, strict=True) if a != b)
