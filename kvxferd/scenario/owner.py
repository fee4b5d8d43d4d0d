"""A separate owner ("prefill") process with a raw NIXL agent, driven over a pipe.

:class:`OwnerProcess` starts a process (multiprocessing ``spawn``) that allocates one byte tensor
per region on a device (DRAM or a GPU), fills every 8-byte word with
:func:`~kvxferd.scenario.pattern.pattern_words` (so any misplaced byte is detectable), registers
the regions with its own :class:`kvxferd.nixl.NixlAgent` and, unless ``leases=False``, runs a
lease table fed by NIXL notifications. It answers the commands of :class:`OwnerCommand`. The
benchmark's naive baseline, the data-plane benchmark and the two-process transfer tests all use
it. The pipe is plumbing between processes this module starts; the daemon's wire is protobuf.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from enum import StrEnum
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np

from kvxferd.scenario.pattern import Int64Array, block_digests, fill_pattern, region_rows

if TYPE_CHECKING:
    import torch

    from kvxferd.nixl import MemType

START_TIMEOUT_S = 120.0
Released = tuple[str, str, int]


class OwnerCommand(StrEnum):
    """What :meth:`OwnerProcess.call` may ask; the arguments follow the command."""

    STOP = "stop"
    ADD_REMOTE = "add_remote"  # (agent name, metadata): load a reader's metadata
    HOLD = "hold"  # (request ID, readers, ttl_s): hold a lease
    CONFIRM = "confirm"  # (request ID, reader key): the reader's ticket
    STRAY = "stray"  # notifications that matched no lease
    NOTIFY = "notify"  # (agent name, message): send a NIXL notification
    RELEASED = "released"  # [(request ID, reason, readers done)] so far
    DIGESTS = "digests"  # (region, block IDs, block bytes): BLAKE2b-64 hex per block


@dataclass(frozen=True)
class OwnerSpec:
    """The owner's agent ``name`` and one region of ``region_bytes[i]`` bytes per entry."""

    name: str
    region_bytes: tuple[int, ...]
    seed: int = 1
    fill: bool = True
    progress_delay_us: int = 100
    device: str = "cpu"
    leases: bool = True


def cuda_index(device: str) -> int | None:
    """The CUDA ordinal of ``cuda`` / ``cuda:N``; None for ``cpu``."""
    if not device.startswith("cuda"):
        return None
    _, _, idx = device.partition(":")
    return int(idx or 0)


def mem_type(device: str) -> MemType:
    from kvxferd.nixl import MemType

    return MemType.VRAM if device.startswith("cuda") else MemType.DRAM


def quiet_nixl() -> None:
    """NIXL logs INFO lines through its own logger; keep reports clean unless the user asked
    for a level with ``NIXL_LOG_LEVEL``."""
    import kvxferd.nixl  # noqa: F401  (configures the "nixl" logger)

    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)


def _owner_main(spec: OwnerSpec, conn: Connection) -> None:
    import torch

    from kvxferd.nixl import AgentOptions, NixlAgent
    from kvxferd.transfer import LeaseTable, NotificationPump

    quiet_nixl()
    cuda = cuda_index(spec.device)
    agent: NixlAgent | None = None
    pump: NotificationPump | None = None
    try:  # every failure, the start's included, goes back to the parent
        if cuda is not None:
            torch.cuda.set_device(cuda)
        options = AgentOptions(progress_delay_us=spec.progress_delay_us)
        agent = NixlAgent(spec.name, cuda_device=cuda, options=options)
        agent.start()
        tensors = [torch.zeros(n, dtype=torch.uint8, device=spec.device) for n in spec.region_bytes]
        if spec.fill:
            for i, t in enumerate(tensors):
                fill_pattern(t, spec.seed, i)
        if cuda is not None:
            torch.cuda.synchronize()
        regions = region_rows(tensors)
        agent.register(regions, mem_type(spec.device))
        released: list[Released] = []
        leases = LeaseTable()
        leases.subscribe(lambda r: released.append((r.request_id, r.reason.value, r.readers_done)))
        if spec.leases:
            pump = NotificationPump(agent, leases, reap_interval_s=0.05)
            pump.start()
        owned = _Owned(agent, leases, released, tensors)
        conn.send((spec.name, agent.metadata(), regions, os.getpid()))
        while True:
            try:
                cmd, *args = conn.recv()
            except EOFError:
                break
            if cmd == OwnerCommand.STOP:
                conn.send(None)
                break
            try:
                conn.send(_answer(cmd, args, owned))
            except Exception as exc:
                conn.send(exc)
    except Exception as exc:
        with contextlib.suppress(Exception):
            conn.send(exc)
    finally:
        if pump is not None:
            pump.stop()
        if agent is not None:
            agent.close()


@dataclass
class _Owned:
    """What the owner process holds while it answers commands."""

    agent: Any
    leases: Any
    released: list[Released]
    tensors: list[torch.Tensor]


def _answer(cmd: str, args: list[Any], o: _Owned) -> Any:
    agent, leases = o.agent, o.leases
    if cmd == OwnerCommand.ADD_REMOTE:
        agent.add_remote(args[0], args[1])
        return None
    if cmd == OwnerCommand.HOLD:
        rid, readers, ttl = args
        leases.hold(rid, [np.arange(4)], readers=readers, ttl_s=ttl)
        return None
    if cmd == OwnerCommand.CONFIRM:
        return leases.confirm(args[0], args[1], 10.0).ticket
    if cmd == OwnerCommand.STRAY:
        return leases.stray_notifications
    if cmd == OwnerCommand.NOTIFY:
        agent.send_notif(args[0], args[1])
        return None
    if cmd == OwnerCommand.RELEASED:
        return list(o.released)
    if cmd == OwnerCommand.DIGESTS:
        region, blocks, block_bytes = args
        return block_digests(o.tensors[region], blocks, block_bytes)
    known = ", ".join(c.value for c in OwnerCommand)
    return ValueError(f"unknown owner command {cmd!r}: send one of {known}")


class OwnerProcess:
    """Handle on a spawned owner; :meth:`call` sends a command and returns its answer."""

    def __init__(
        self, spec: OwnerSpec, *, wait: bool = True, start_timeout_s: float = START_TIMEOUT_S
    ) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_owner_main, args=(spec, child), daemon=True)
        self.proc.start()
        child.close()
        self.spec = spec
        self.name = spec.name
        self.mem = mem_type(spec.device)
        self.metadata = b""
        self.regions: Int64Array = np.empty((0, 3), dtype=np.int64)
        self.pid = self.proc.pid or 0
        if wait:
            self.ready(start_timeout_s)

    def ready(self, start_timeout_s: float = START_TIMEOUT_S) -> OwnerProcess:
        """Wait for the owner's hello (name, NIXL metadata, regions, pid)."""
        if self.metadata:
            return self
        if not self._conn.poll(start_timeout_s):
            self.kill()
            raise TimeoutError(
                f"owner {self.spec.name} did not start in {start_timeout_s:.0f}s "
                "(a first CUDA or NIXL start can be slow: pass a longer start_timeout_s)"
            )
        try:
            hello = self._conn.recv()
        except EOFError:
            self.proc.join(10)
            code = self.proc.exitcode
            self.kill()
            raise RuntimeError(
                f"owner {self.spec.name} exited (status {code}) before it was ready; "
                "its traceback is on stderr above"
            ) from None
        if isinstance(hello, Exception):
            self.kill()
            raise RuntimeError(
                f"owner {self.spec.name} failed to start on {self.spec.device}: {hello!r} "
                "(a cuda device needs a GPU that torch sees; cpu needs nothing)"
            )
        self.name, self.metadata, self.regions, self.pid = hello
        return self

    def call(self, cmd: OwnerCommand | str, *args: Any, timeout_s: float = 30.0) -> Any:
        self._conn.send((cmd, *args))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"owner {self.spec.name} did not answer {cmd} in {timeout_s}s")
        out = self._conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def wait_released(self, count: int, timeout_s: float = 10.0) -> list[Released]:
        """The released leases once ``count`` are there, or what there is at ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            rel: list[Released] = self.call(OwnerCommand.RELEASED)
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
                os.kill(self.proc.pid or 0, signal.SIGCONT)
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.call(OwnerCommand.STOP, timeout_s=5)
            self.proc.join(5)
        self.kill()
        self._conn.close()
