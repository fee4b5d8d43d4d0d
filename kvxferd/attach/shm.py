"""POSIX shared memory (``/dev/shm``) for DRAM regions, mapped with :mod:`mmap`.

``multiprocessing.shared_memory`` is not used: on Python 3.11 its resource tracker unlinks a
segment when *any* process that merely opened it exits, which would pull an engine's memory out
from under the daemon (and the other way round). Here the creator unlinks explicitly.

Tensors made by :meth:`ShmSegment.tensor` keep the mapping alive (torch holds the ``mmap``
object); dropping the segment and every tensor unmaps it. ``unlink`` removes the name at once
(existing mappings stay valid, the memory is freed when the last one goes).

Each mapping also holds an open file descriptor while it lives (Python's ``mmap`` keeps a
duplicate of the one it mapped), so a pool of N regions holds N descriptors, and a failed
Attach must let go of every mapping it made (:func:`kvxferd.daemon.attach_memory.build_memory`;
on the engine's side ``EngineClient.attach`` and ``shared_tensors``) or the descriptors pile up
until every later Attach fails with EMFILE.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import stat
from pathlib import Path

import torch

from kvxferd.errors import InvalidRequest, ResourceExhausted, SpecError
from kvxferd.logs import kv

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_NO_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)


def nofile_fix(who: str = "daemon") -> str:
    """How to get more descriptors for ``who`` (the process that maps: daemon or engine)."""
    return (
        f"raise the {who}'s open-files limit (LimitNOFILE= in its systemd unit, ulimit -n in"
        " the shell that starts it; each region of an attached DRAM pool keeps one descriptor"
        " open), or attach fewer regions (a cross-layer layout has one region for all layers)"
    )


_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def shm_path(name: str) -> Path:
    """The file of shm_open name ``name`` (``/kvxferd-x`` or ``kvxferd-x``)."""
    bare = name.removeprefix("/")
    if not _NAME.match(bare) or bare in (".", ".."):
        raise InvalidRequest(
            f"{name!r} is not a POSIX shared-memory name",
            field="shm_name",
            fix="use '/name' with letters, digits, '.', '_' or '-' (no other '/')",
        )
    return SHM_DIR / bare


def out_of_descriptors(exc: OSError, what: str, who: str = "daemon") -> ResourceExhausted | None:
    """The refusal for ``what`` when ``exc`` is EMFILE/ENFILE (this process, ``who``: the
    daemon or the engine, or the host, has no file descriptor left): a limit to raise, not a
    /dev/shm to enlarge."""
    if exc.errno not in _NO_DESCRIPTORS:
        return None
    if exc.errno == errno.EMFILE:
        return ResourceExhausted(
            f"cannot {what}: the {who}'s open-files limit is reached ({exc.strerror})",
            fix=nofile_fix(who),
        )
    return ResourceExhausted(
        f"cannot {what}: the host has no open file left ({exc.strerror})",
        fix="raise the host's limit (sysctl fs.file-max) or stop what holds so many files"
        " open; each region of an attached DRAM pool keeps one descriptor open",
    )


SHM_FIX = "enlarge /dev/shm (in Kubernetes: an emptyDir with medium Memory), or attach fewer blocks"


def check_shm_room(nbytes: int) -> None:
    """Refuse ``nbytes`` of new shared memory when /dev/shm has less free: a segment larger
    than what is left is created sparse, and the first write past the end of the room (a
    pull into it, or the engine computing into it) faults the process (SIGBUS) instead of
    failing."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return  # nothing to measure against: ShmSegment.create still reserves each segment
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise ResourceExhausted(
            f"the pool needs {nbytes} bytes of shared memory, but {SHM_DIR} has {free} free",
            fix=SHM_FIX,
        )


class ShmSegment:
    """One shared-memory segment mapped read-write into this process."""

    def __init__(self, name: str, mapping: mmap.mmap, size: int, *, created: bool) -> None:
        self.name = "/" + name.removeprefix("/")
        self.size = size
        self.created = created
        self._mmap: mmap.mmap | None = mapping

    @classmethod
    def create(cls, name: str, size: int, *, who: str = "daemon") -> ShmSegment:
        """Create a new segment of ``size`` bytes (fails if the name exists); ``who`` creates
        it (the daemon or the engine), as a refusal for want of descriptors names it."""
        path = shm_path(name)
        if size <= 0:
            raise InvalidRequest(f"shared memory size must be positive, got {size}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError as exc:
            raise InvalidRequest(
                f"shared memory {path} already exists",
                field="shm_name",
                fix="remove the stale segment or pick another name",
            ) from exc
        except OSError as exc:
            if refusal := out_of_descriptors(exc, f"create shared memory {path}", who):
                raise refusal from exc
            raise
        try:
            os.ftruncate(fd, size)
            # Reserve the pages now: ENOSPC here, not a SIGBUS at the first write past the room.
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, OverflowError) as exc:  # OverflowError: beyond what a file offset holds
            os.close(fd)
            path.unlink(missing_ok=True)
            what = f"map {size} bytes of shared memory at {path}"
            if isinstance(exc, OSError) and (refusal := out_of_descriptors(exc, what, who)):
                raise refusal from exc
            raise ResourceExhausted(
                f"cannot create {size} bytes of shared memory at {path}: {exc}", fix=SHM_FIX
            ) from exc
        os.close(fd)
        log.info("shared memory created", extra=kv(name=path.name, bytes=size))
        return cls(name, mapping, size, created=True)

    @classmethod
    def open(cls, name: str, *, who: str = "daemon") -> ShmSegment:
        """Map an existing segment (its whole size); ``who`` as for :meth:`create`."""
        path = shm_path(name)
        try:  # never through a symlink: the name must be a segment itself
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError as exc:
            raise SpecError(
                f"shared memory {name!r} does not exist ({path})",
                fix="create it before attaching, and share /dev/shm between engine and daemon",
            ) from exc
        except PermissionError as exc:
            raise SpecError(
                f"no permission to open shared memory {path}: {exc}",
                fix="run the engine and the daemon as the same user (or make it group-writable)",
            ) from exc
        except OSError as exc:  # a symlink (ELOOP), a directory (EISDIR), ...
            if refusal := out_of_descriptors(exc, f"open shared memory {path}", who):
                raise refusal from exc
            raise SpecError(
                f"{path} is not a shared-memory segment ({exc.strerror})",
                field="shm_name",
                fix="name the segment the engine created with shm_open (a plain file in /dev/shm)",
            ) from exc
        try:
            st = os.fstat(fd)
            size = st.st_size
            if not stat.S_ISREG(st.st_mode):
                raise SpecError(
                    f"{path} is not a shared-memory segment (not a regular file)",
                    field="shm_name",
                    fix="name the segment the engine created with shm_open (a plain file in"
                    " /dev/shm)",
                )
            if size <= 0:
                raise SpecError(f"shared memory {path} is empty", fix="size it with ftruncate")
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            if refusal := out_of_descriptors(exc, f"map shared memory {path}", who):
                raise refusal from exc
            raise
        finally:
            os.close(fd)
        return cls(name, mapping, size, created=False)

    def tensor(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """A uint8 tensor over ``[offset, offset + nbytes)``; it keeps the mapping alive."""
        if self._mmap is None:
            raise InvalidRequest(f"shared memory {self.name} was released")
        n = self.size - offset if nbytes is None else nbytes
        if offset < 0 or n <= 0 or offset + n > self.size:
            raise SpecError(
                f"bytes [{offset}, {offset + n}) are outside shared memory {self.name} of"
                f" {self.size} bytes",
                fix="check the handle's offset and the segment's size",
            )
        return torch.frombuffer(self._mmap, dtype=torch.uint8, count=n, offset=offset)

    def release(self) -> None:
        """Drop this object's reference to the mapping (unmapped once no tensor uses it)."""
        self._mmap = None

    def unlink(self) -> None:
        """Remove the name (creator only); mappings stay valid until dropped."""
        with contextlib.suppress(FileNotFoundError):
            shm_path(self.name).unlink()
            log.info("shared memory unlinked", extra=kv(name=self.name))
