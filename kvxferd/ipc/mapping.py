"""Reader side: the owner's regions mapped over CUDA IPC, one set per peer generation.

:class:`MappingCache` keeps, per peer (its NIXL agent name), the mappings of *one* incarnation:
the key is ``(agent, instance_id, registration_generation)``. Getting another key for the same
agent drops the old set first, so a restarted or re-registered owner is never read through
stale mappings. Sets are also dropped when :meth:`MappingCache.forget` is called (the peer was
invalidated: it died, restarted, or its link was evicted), when they have gone unused for
``idle_s`` (:meth:`MappingCache.sweep`; bounds how long a silent, restarted owner's freed
memory stays pinned), and when the cache is closed (this daemon's pool went away: its engine
detached). A dropped set is closed as soon as no pull uses it (:meth:`PeerMaps.use`), never
under a running copy.

Each distinct handle is opened once (regions that share an allocation share the mapping), and
every region is checked against the mapped allocation's size before it is used: a region that
runs past its mapping is refused here, so a copy can never leave the mapped memory. A failed
open is remembered per key (:meth:`MappingCache.failure`), so the pulls of that peer generation
go over NIXL without retrying (or, from an owner served by KERNEL only, fail with the reason).

The handles may be the owner's own exports or, for an engine-attached IMPORTED VRAM pool, the
engine's handles the owner forwards (:meth:`kvxferd.ipc.publish.Publisher.forward`): the key
carries the owner's registration generation either way, so a re-attached engine's new handles
are a new key, and the old set is dropped as for any generation change.

The opener is injected: the daemon opens with :class:`kvxferd.attach.cuda_ipc.IpcMapping`;
CPU tests use host buffers. Event-loop only.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvxferd.errors import KvxferdError, PeerUnavailable, SpecError
from kvxferd.ipc.host import device_ordinal
from kvxferd.ipc.publish import IpcPool
from kvxferd.logs import kv

log = logging.getLogger(__name__)

Key = tuple[str, str, int]  # agent name, instance ID, registration generation


class Mapped(Protocol):
    """One opened allocation."""

    @property
    def size(self) -> int: ...

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor: ...

    def close(self) -> None: ...


Opener = Callable[[bytes, int], Mapped]  # (handle, this process's device ordinal) -> mapping


class _CudaMapped:
    """An :class:`~kvxferd.attach.cuda_ipc.IpcMapping` that can be closed on purpose."""

    def __init__(self, handle: bytes, device: int) -> None:
        from kvxferd.attach.cuda_ipc import IpcMapping

        self._m = IpcMapping(handle, device)

    @property
    def size(self) -> int:
        return self._m.size

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        return self._m.tensor(offset, nbytes)

    def close(self) -> None:
        self._m.close()


def cuda_opener(handle: bytes, device: int) -> Mapped:
    return _CudaMapped(handle, device)


@dataclass(eq=False)
class PeerMaps:
    """The mapped regions of one peer generation: ``regions[i]`` is region i, 1-D uint8, on
    ``device``, exactly the region's advertised bytes."""

    key: Key
    device: int
    regions: list[torch.Tensor]
    mappings: list[Mapped]
    opened_at: float
    last_used: float
    users: int = 0
    dropped: str = ""  # why, once dropped; closed when users reaches 0
    closed: bool = False
    _on_close: list[Callable[[PeerMaps], None]] = field(default_factory=list)

    @contextlib.contextmanager
    def use(self) -> Iterator[list[torch.Tensor]]:
        """The regions, kept mapped until the block ends even if the set is dropped meanwhile."""
        if self.closed:
            raise PeerUnavailable(
                f"the CUDA IPC mappings of peer {self.key[0]} were dropped ({self.dropped})",
                fix="retry the pull: it maps the peer's current generation",
            )
        self.users += 1
        try:
            yield self.regions
        finally:
            self.users -= 1
            self._close_if_done()

    def drop(self, why: str) -> None:
        if not self.dropped:
            self.dropped = why
        self._close_if_done()

    def _close_if_done(self) -> None:
        if self.closed or not self.dropped or self.users:
            return
        self.closed = True
        self.regions = []
        for m in self.mappings:
            try:
                m.close()
            except KvxferdError as err:
                log.warning("closing a cuda ipc mapping failed", extra=kv(error=str(err)))
        self.mappings = []
        log.info(
            "cuda ipc mappings dropped",
            extra=kv(
                peer=self.key[0], instance=self.key[1], generation=self.key[2], why=self.dropped
            ),
        )
        for cb in self._on_close:
            cb(self)


class MappingCache:
    """Peer generations' mappings on this process's ``device`` (ordinal)."""

    def __init__(
        self,
        *,
        device: int,
        opener: Opener = cuda_opener,
        ordinal_of: Callable[[str], int | None] = device_ordinal,
        idle_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device = device
        self.idle_s = idle_s
        self._opener = opener
        self._ordinal_of = ordinal_of
        self._clock = clock
        self._maps: dict[str, PeerMaps] = {}  # agent -> its current generation's set
        self._failed: dict[Key, str] = {}  # key -> why opening failed
        self._closing: set[PeerMaps] = set()  # dropped, still in use

    # -- queries ------------------------------------------------------------------------------

    def current(self, agent: str) -> PeerMaps | None:
        return self._maps.get(agent)

    def failure(self, key: Key) -> str | None:
        return self._failed.get(key)

    @property
    def open_sets(self) -> int:
        return len(self._maps) + len(self._closing)

    # -- lifecycle ----------------------------------------------------------------------------

    def get(self, key: Key, ipc: IpcPool) -> PeerMaps:
        """The mapped regions of peer generation ``key``; opened on first use. Raises
        :class:`~kvxferd.errors.SpecError` (and remembers why) when they cannot be opened."""
        agent = key[0]
        cur = self._maps.get(agent)
        if cur is not None and cur.key == key:
            cur.last_used = self._clock()
            return cur
        if cur is not None:
            self._drop(cur, f"peer is now instance {key[1]} generation {key[2]}")
        why = self._failed.get(key)
        if why is not None:
            raise SpecError(
                why,
                fix="check that both daemons see the same GPUs; the peer's next generation"
                " (it restarted or re-attached) is opened afresh",
            )
        try:
            maps = self._open(key, ipc)
        except KvxferdError as err:
            self._failed[key] = str(err)
            self._failed = dict(list(self._failed.items())[-256:])  # bounded
            log.warning(
                "cuda ipc open failed; no KERNEL pulls from this peer generation",
                extra=kv(peer=agent, instance=key[1], generation=key[2], error=str(err)),
            )
            raise
        self._maps[agent] = maps
        return maps

    def forget(self, agent: str, why: str) -> bool:
        """Drop ``agent``'s mappings (it died, restarted, re-registered or was evicted)."""
        cur = self._maps.get(agent)
        if cur is None:
            return False
        self._drop(cur, why)
        return True

    def sweep(self) -> list[str]:
        """Drop sets unused for ``idle_s``; returns the agents dropped."""
        now = self._clock()
        idle = [
            a for a, m in self._maps.items() if m.users == 0 and now - m.last_used >= self.idle_s
        ]
        for a in idle:
            self._drop(self._maps[a], f"unused for {self.idle_s:g}s")
        return idle

    def close(self, why: str = "this daemon's pool went away") -> None:
        for m in list(self._maps.values()):
            self._drop(m, why)

    def _drop(self, maps: PeerMaps, why: str) -> None:
        if self._maps.get(maps.key[0]) is maps:
            del self._maps[maps.key[0]]
        self._closing.add(maps)
        maps.drop(why)
        if maps.closed:
            self._closing.discard(maps)

    def _open(self, key: Key, ipc: IpcPool) -> PeerMaps:
        if not ipc.regions:
            raise SpecError(f"peer {key[0]} exports no CUDA IPC regions: {ipc.unavailable}")
        uuid = ipc.regions[0].device_uuid
        if any(r.device_uuid != uuid for r in ipc.regions):
            raise SpecError(f"peer {key[0]} spreads its regions over several GPUs")
        ordinal = self._ordinal_of(uuid)
        if ordinal is None:
            raise SpecError(
                f"the peer's GPU {uuid} is not visible to this process",
                fix="give both daemons the same GPUs (CUDA_VISIBLE_DEVICES)",
            )
        opened: dict[bytes, Mapped] = {}
        regions: list[torch.Tensor] = []
        try:
            for i, r in enumerate(ipc.regions):
                m = opened.get(r.handle)
                if m is None:
                    # Mapped into *our* device's context (the copy runs there); a peer GPU
                    # is reached through peer access, which the open enables.
                    m = opened[r.handle] = self._opener(r.handle, self.device)
                if not m.size:  # cuMemGetAddressRange failed: no bound to check against
                    raise SpecError(
                        f"the size of the CUDA allocation behind the peer's region {i} could"
                        " not be read, so a copy from it could not be kept inside it",
                        fix="pulls from this peer use NIXL (transfer.strategy = auto falls"
                        " back); restart the peer if this persists",
                    )
                if r.offset + r.nbytes > m.size:
                    raise SpecError(
                        f"the peer's region {i} ([{r.offset}, {r.offset + r.nbytes})) runs past"
                        f" its CUDA allocation of {m.size} bytes",
                        fix="the peer's export is inconsistent: restart it",
                    )
                regions.append(m.tensor(r.offset, r.nbytes))
        except BaseException:
            for m in opened.values():
                with contextlib.suppress(Exception):
                    m.close()
            raise
        now = self._clock()
        maps = PeerMaps(key, self.device, regions, list(opened.values()), now, now)
        maps._on_close.append(self._closing.discard)
        log.info(
            "cuda ipc mappings opened",
            extra=kv(
                peer=key[0],
                instance=key[1],
                generation=key[2],
                regions=len(regions),
                allocations=len(opened),
                peer_gpu=uuid,
                ordinal=ordinal,
            ),
        )
        return maps
