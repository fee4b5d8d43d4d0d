"""CMA (cross-memory attach): the owner's process and the ``process_vm_readv`` system call.

A same-host owner whose pool is in host memory can be read without UCX: the reader copies the
pull's byte ranges straight out of the owner's address space with ``process_vm_readv(2)``,
many ranges per call (:mod:`.cma_reader`). Which process to read is never taken from the
handshake payload: it is the process the kernel names (``SO_PEERCRED``) on the connected
same-host Peer socket that a Heartbeat verified to reach the handshaken instance
(:class:`~kvxferd.wire.local.LocalTransport`). :class:`OwnerProcess` ties that pid to the
link's instance and generation and to that very connection; the peer directory drops it when
the link is invalidated, replaced, evicted or handshaken again, and a pidfd tells whether the
process is still the one that was verified (a pid is reused only after its process exited).

:func:`probe` reads a few bytes of the owner's first registered region once per verified
connection; a refusal (EPERM: ptrace rules, ESRCH, EFAULT) makes the peer CMA-ineligible with
the reason and the fix (:func:`explain`). :func:`allow_readers` is what an owner does at start
so that same-user readers may read it under Yama's ``ptrace_scope = 1`` (docs/strategies.md,
"CMA", weighs it).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import select
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from kvxferd.logs import kv
from kvxferd.wire.local import LocalTransport

log = logging.getLogger(__name__)

IOV_MAX = 1024  # iovecs one process_vm_readv call takes (Linux UIO_MAXIOV)
PROBE_BYTES = 4096
YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = -1

ReadV = Callable[[int, int, int, int], int]
"""``(pid, local iovec array address, remote iovec array address, count) -> bytes read``;
raises :class:`OSError` with the call's errno."""

_libc = ctypes.CDLL(None, use_errno=True)
_sys_readv = _libc.process_vm_readv
_sys_readv.argtypes = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_ulong,
]
_sys_readv.restype = ctypes.c_ssize_t


def process_vm_readv(pid: int, local_iov: int, remote_iov: int, count: int) -> int:
    """One ``process_vm_readv(pid, local_iov, count, remote_iov, count, 0)`` (ctypes releases
    the GIL for its duration, so worker threads copy in parallel)."""
    n = int(_sys_readv(pid, local_iov, count, remote_iov, count, 0))
    if n < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return n


def explain(err: OSError, pid: int) -> tuple[str, str]:
    """``(what went wrong, how to fix it)`` for a failed read of process ``pid``."""
    code = err.errno
    if code == errno.EPERM:
        return (
            f"the kernel does not let this daemon read process {pid} (EPERM from"
            " process_vm_readv: ptrace access rules)",
            "run both daemons as the same user; with kernel.yama.ptrace_scope = 1 keep"
            " transfer.cma = true on the owner (it then allows same-user readers) or set the"
            " scope to 0; scope 2 or 3, a container without CAP_SYS_PTRACE or a seccomp profile"
            " that blocks process_vm_readv needs CAP_SYS_PTRACE for the reader; or set"
            " transfer.cma = false",
        )
    if code == errno.ESRCH:
        return (
            f"process {pid} does not exist (ESRCH): the owner exited or restarted",
            "nothing to do: the next handshake finds the new owner process",
        )
    if code == errno.EFAULT:
        return (
            f"an address of the owner's registered regions is not mapped in process {pid}"
            " (EFAULT): that process does not hold the memory its handshake described",
            "check that the peer socket belongs to the daemon that registered the pool; set"
            " transfer.cma = false to read it over NIXL",
        )
    if code == errno.ENOSYS:
        return (
            "process_vm_readv is not available on this kernel or is blocked (ENOSYS)",
            "allow process_vm_readv in the seccomp profile, or set transfer.cma = false",
        )
    return (
        f"process_vm_readv of process {pid} failed: {err.strerror or err} (errno {code})",
        "set transfer.cma = false to read this peer over NIXL, and report it with the log",
    )


def probe(pid: int, base: int, length: int, readv: ReadV = process_vm_readv) -> str | None:
    """Read up to :data:`PROBE_BYTES` at ``base`` of process ``pid`` into scratch: None when
    it worked, else why not and the fix (one line)."""
    if pid <= 0:
        return "the owner's process is not visible in this daemon's PID namespace (pid 0)"
    n = max(1, min(PROBE_BYTES, int(length)))
    scratch = np.empty(n, dtype=np.uint8)
    local = np.array([scratch.ctypes.data, n], dtype=np.uint64)
    remote = np.array([base, n], dtype=np.uint64)
    try:
        got = readv(pid, local.ctypes.data, remote.ctypes.data, 1)
    except OSError as err:
        what, fix = explain(err, pid)
        return f"probing process {pid}: {what}; fix: {fix}"
    if got != n:
        return f"probing process {pid}: read {got} of {n} bytes of its first region"
    return None


def allow_readers(scope_file: str = YAMA_SCOPE) -> bool:
    """Let processes of this daemon's user read it with process_vm_readv where Yama would
    refuse them (``ptrace_scope = 1``: only ancestors may): ``prctl(PR_SET_PTRACER, ANY)``.
    Does nothing elsewhere (no Yama or scope 0: not needed; 2 or 3: prctl cannot relax it).
    Returns whether it was called."""
    try:
        with open(scope_file) as f:
            scope = f.read().strip()
    except OSError:
        return False
    if scope != "1":
        return False
    if _libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY & 0xFFFFFFFFFFFFFFFF)):
        e = ctypes.get_errno()
        log.warning("prctl(PR_SET_PTRACER) failed", extra=kv(error=os.strerror(e)))
        return False
    log.info("same-user readers may read this daemon's memory (CMA, ptrace_scope 1)")
    return True


@dataclass
class OwnerProcess:
    """The owner daemon's process, as the kernel named it on the connected same-host socket.

    ``key``: the peer incarnation (agent, instance, generation) the Heartbeat through
    ``connection`` of ``transport`` verified; ``channel``: the object the link's client sends
    its same-host calls through (CMA is used only while it still does, over that very
    connection: :meth:`same_channel`); ``pidfd``: open on the
    process (-1 where pidfd_open is unavailable) so that its exit is seen; ``probed``: the
    probe's outcome (None: readable; unset until the first pull that could use it)."""

    pid: int
    uid: int
    key: tuple[str, str, int]
    connection: int
    channel: object
    transport: LocalTransport | None = None
    pidfd: int = -1
    probed: str | None = field(default="not probed yet")
    done_probe: bool = False
    users: int = 0
    dropped: str = ""

    @classmethod
    def open(
        cls,
        pid: int,
        uid: int,
        key: tuple[str, str, int],
        *,
        connection: int,
        channel: object,
        transport: LocalTransport | None,
    ) -> OwnerProcess:
        fd = -1
        if pid > 0:
            with contextlib.suppress(OSError, AttributeError):
                fd = os.pidfd_open(pid)
        return cls(pid, uid, key, connection, channel, transport, fd)

    def same_channel(self, channel: object) -> bool:
        """Whether ``channel`` (the link's same-host transport now) is the one verified, still
        on the connection whose credentials gave the pid."""
        t = self.transport
        return channel is self.channel and t is not None and t.current(self.connection)

    def exited(self) -> bool:
        """Whether the process is gone (its pid may name another process now)."""
        if self.pidfd < 0:
            return self.pid <= 0 or not os.path.exists(f"/proc/{self.pid}")
        ready, _, _ = select.select([self.pidfd], [], [], 0)
        return bool(ready)

    def ensure_probed(self, base: int, length: int, readv: ReadV = process_vm_readv) -> str | None:
        """The probe's outcome, probing once (the first time a pull could use CMA)."""
        if not self.done_probe:
            self.probed = probe(self.pid, base, length, readv)
            self.done_probe = True
            if self.probed is not None:
                log.warning("CMA probe failed", extra=kv(pid=self.pid, why=self.probed))
        return self.probed

    @contextlib.contextmanager
    def use(self) -> Iterator[OwnerProcess]:
        """Hold the pidfd open while a copy runs (a drop meanwhile closes it after)."""
        self.users += 1
        try:
            yield self
        finally:
            self.users -= 1
            if self.dropped and self.users == 0:
                self._close_fd()

    def drop(self, why: str) -> None:
        """The link no longer vouches for this process: never read it again."""
        self.dropped = why or "dropped"
        if self.users == 0:
            self._close_fd()

    def _close_fd(self) -> None:
        if self.pidfd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = -1
