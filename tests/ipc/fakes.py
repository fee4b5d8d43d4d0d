"""CUDA IPC stand-ins for CPU tests: "handles" name host buffers, "mappings" are views of them.

The owner's pool is a CPU :class:`~kvxferd.pool.KVPool`; :func:`export_pool` gives it an
:class:`~kvxferd.ipc.publish.IpcPool` whose handles resolve (through a :class:`FakeHost`) to
that pool's region bytes, so a :class:`~kvxferd.ipc.reader.KernelReader` copies real bytes with
the torch twin, and every open and close is counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvxferd.errors import SpecError
from kvxferd.ipc.publish import IpcPool, IpcRegion
from kvxferd.ipc.reader import region_bytes
from kvxferd.ipc.transport import TransportReport
from kvxferd.layout.spec import KVCacheSpec
from kvxferd.pool import KVPool
from kvxferd.staging.facts import PairFacts

UUID = "GPU-00000000-1111-2222-3333-444444444444"


def handle(name: str) -> bytes:
    return name.encode().ljust(64, b"\0")


@dataclass
class FakeMapped:
    host: FakeHost
    name: bytes
    buf: torch.Tensor
    closed: bool = False

    @property
    def size(self) -> int:
        return int(self.buf.numel())

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buf[offset : offset + nbytes]

    def close(self) -> None:
        assert not self.closed, "closed twice"
        self.closed = True
        self.host.closed.append(self.name)


@dataclass
class FakeHost:
    """Exported buffers by handle, and the log of opens and closes."""

    buffers: dict[bytes, torch.Tensor] = field(default_factory=dict)
    opened: list[bytes] = field(default_factory=list)
    closed: list[bytes] = field(default_factory=list)
    fail: str = ""

    def open(self, h: bytes, device: int) -> FakeMapped:
        if self.fail:
            raise SpecError(self.fail)
        buf = self.buffers.get(h)
        if buf is None:
            raise SpecError("cuIpcOpenMemHandle failed: CUDA_ERROR_MAP_FAILED")
        self.opened.append(h)
        return FakeMapped(self, h, buf)

    @property
    def open_now(self) -> int:
        return len(self.opened) - len(self.closed)


def export_pool(host: FakeHost, pool: KVPool, tag: str) -> IpcPool:
    """One fake allocation per region of ``pool`` (CPU), registered with ``host``."""
    regions = []
    for i, t in enumerate(region_bytes(pool)):
        h = handle(f"{tag}-{i}")
        host.buffers[h] = t
        regions.append(IpcRegion(h, 0, int(t.numel()), UUID))
    return IpcPool(tuple(regions))


def ordinal_of(uuid: str) -> int | None:
    return 0 if uuid == UUID else None


@dataclass
class FakeInfo:
    """A handshaken peer's info, as the strategy decision reads it."""

    spec: KVCacheSpec
    tp_rank: int = 0
    tp_size: int = 1


@dataclass
class FakeRemote:
    """A handshaken peer (:class:`kvxferd.daemon.peers.RemoteDescription`), as ``decide`` and
    ``Staging.kernel_ready`` read it."""

    info: FakeInfo
    regions: np.ndarray
    host_id: str
    ipc: IpcPool | None
    agent_name: str = "owner"
    instance_id: str = "i1"
    generation: int = 1
    kernel_only: str = ""
    facts: PairFacts = field(default_factory=PairFacts)

    @property
    def key(self) -> tuple[str, str, int]:
        return self.agent_name, self.instance_id, self.generation


@dataclass
class FakeLink:
    """A peer link (:class:`kvxferd.daemon.peers.PeerLink`): the peer and its probed transport."""

    remote: FakeRemote
    transport: TransportReport | None
