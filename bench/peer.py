"""A separate owner ("prefill") process for benchmarks and two-process tests.

:func:`spawn_owner` starts a process (multiprocessing ``spawn``) that allocates DRAM regions,
fills every 8-byte word with a value encoding (seed, region, word index) so any misplaced byte
is detectable, registers them with its own :class:`kvxferd.nixl.NixlAgent`, runs a lease table
fed by NIXL notifications, and answers commands over a pipe. The pipe is test/bench plumbing
between processes this module starts; the daemon's wire uses protobuf.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

_MULT = np.int64(0x9E3779B97F4A7C15 - (1 << 64))  # golden-ratio odd constant, as int64


def pattern_words(seed: int, region: int, first_word: int, count: int) -> np.ndarray:
    """The int64 words the owner writes at word indices ``first_word..first_word+count``."""
    idx = np.arange(first_word, first_word + count, dtype=np.int64)
    with np.errstate(over="ignore"):
        return idx * _MULT + np.int64((seed << 48) + (region << 40) + 1)


def fill_pattern(buf: Any, seed: int, region: int) -> None:
    """Fill a torch uint8/any-dtype CPU tensor ``buf`` with :func:`pattern_words`."""
    import torch

    words = buf.view(torch.uint8).view(-1).view(torch.int64)
    chunk = 1 << 24
    for start in range(0, words.numel(), chunk):
        n = min(chunk, words.numel() - start)
        words[start : start + n] = torch.from_numpy(pattern_words(seed, region, start, n))


@dataclass(frozen=True)
class OwnerSpec:
    name: str
    region_bytes: tuple[int, ...]
    seed: int = 1
    fill: bool = True
    progress_delay_us: int = 100


def _owner_main(spec: OwnerSpec, conn: Connection) -> None:
    import torch

    from kvxferd.nixl import AgentOptions, MemType, NixlAgent
    from kvxferd.transfer import LeaseTable, NotificationPump

    agent = NixlAgent(spec.name, options=AgentOptions(progress_delay_us=spec.progress_delay_us))
    agent.start()
    tensors = [torch.empty(n, dtype=torch.uint8) for n in spec.region_bytes]
    if spec.fill:
        for i, t in enumerate(tensors):
            fill_pattern(t, spec.seed, i)
    regions = np.array([[t.data_ptr(), t.numel(), 0] for t in tensors], dtype=np.int64)
    agent.register(regions, MemType.DRAM)
    released: list[tuple[str, str, int]] = []
    leases = LeaseTable()
    leases.subscribe(lambda r: released.append((r.request_id, r.reason.value, r.readers_done)))
    pump = NotificationPump(agent, leases, reap_interval_s=0.05)
    pump.start()
    conn.send((spec.name, agent.metadata(), regions, os.getpid()))
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "stop":
                conn.send(None)
                break
            if cmd == "add_remote":
                agent.add_remote(args[0], args[1])
                conn.send(None)
            elif cmd == "hold":
                rid, readers, ttl = args
                leases.hold(rid, [np.arange(4)], readers=readers, ttl_s=ttl)
                conn.send(None)
            elif cmd == "confirm":  # (request ID, reader key): the reader's ticket
                conn.send(leases.confirm(args[0], args[1], 10.0).ticket)
            elif cmd == "stray":
                conn.send(leases.stray_notifications)
            elif cmd == "notify":
                agent.send_notif(args[0], args[1])
                conn.send(None)
            elif cmd == "released":
                conn.send(list(released))
            elif cmd == "sum":  # (region, offsets, length): checksum of selected ranges
                region, offsets, length = args
                t = tensors[region]
                idx = (np.asarray(offsets)[:, None] + np.arange(length)[None, :]).ravel()
                conn.send(int(t[torch.from_numpy(idx)].to(torch.int64).sum()))
            else:
                conn.send(ValueError(f"unknown command {cmd}"))
        except Exception as exc:
            conn.send(exc)
    pump.stop()
    agent.close()


class OwnerProcess:
    """Handle on a spawned owner; :meth:`call` sends a command and returns its answer."""

    def __init__(self, spec: OwnerSpec, *, wait: bool = True) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_owner_main, args=(spec, child), daemon=True)
        self.proc.start()
        child.close()
        self.spec = spec
        self.name = spec.name
        self.metadata = b""
        self.regions = np.empty((0, 3), dtype=np.int64)
        self.pid = self.proc.pid or 0
        if wait:
            self.ready()

    def ready(self, start_timeout_s: float = 60.0) -> OwnerProcess:
        """Wait for the owner's hello (name, NIXL metadata, regions, pid)."""
        if self.metadata:
            return self
        if not self._conn.poll(start_timeout_s):
            self.kill()
            raise TimeoutError(f"owner {self.spec.name} did not start in {start_timeout_s}s")
        self.name, self.metadata, self.regions, self.pid = self._conn.recv()
        return self

    def call(self, cmd: str, *args: Any, timeout_s: float = 30.0) -> Any:
        self._conn.send((cmd, *args))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"owner did not answer {cmd} in {timeout_s}s")
        out = self._conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def wait_released(self, count: int, timeout_s: float = 10.0) -> list[tuple[str, str, int]]:
        deadline = time.monotonic() + timeout_s
        while True:
            rel: list[tuple[str, str, int]] = self.call("released")
            if len(rel) >= count or time.monotonic() > deadline:
                return rel
            time.sleep(0.01)

    def stop_signal(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def cont_signal(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.call("stop", timeout_s=5)
            self.proc.join(5)
        self.kill()
        self._conn.close()
