"""The daemon's KV pool as a swappable slot: fixed (owned mode) or attached by an engine.

:class:`PoolSlot` answers "which pool, spec and NIXL metadata does this daemon serve now, under
which registration generation". In owned mode it holds one pool for the daemon's lifetime. In
attached mode it starts empty; :mod:`kvxferd.daemon.attach` fills it on Attach and empties it
on Detach or when the engine's session ends, bumping the generation each time. While empty,
:meth:`PoolSlot.current` raises :class:`~kvxferd.errors.EngineDetached` with what happened and
what to do, which every RPC that needs the pool passes on as its status.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from kvxferd.errors import EngineDetached
from kvxferd.peers import PeerInfo
from kvxferd.pool import KVPool


class SlotState(enum.Enum):
    DETACHED = "DETACHED"
    REGISTERING = "REGISTERING"
    REGISTERED = "REGISTERED"


@dataclass(frozen=True)
class Served:
    """What the slot serves while registered."""

    pool: KVPool
    info: PeerInfo


class PoolSlot:
    """The pool the daemon serves now (see the module docstring)."""

    def __init__(
        self, served: Served | None, metadata: bytes, *, attached_mode: bool, generation: int = 1
    ) -> None:
        self._served = served
        self._metadata = metadata
        self.attached_mode = attached_mode
        self.generation = generation
        self.state = SlotState.REGISTERED if served else SlotState.DETACHED
        self._why = "no engine has attached to this daemon yet (pool.mode = attached)"
        self._since = time.time()

    @classmethod
    def owned(cls, pool: KVPool, info: PeerInfo, metadata: bytes) -> PoolSlot:
        return cls(Served(pool, info), metadata, attached_mode=False)

    @classmethod
    def detached(cls, metadata: bytes) -> PoolSlot:
        return cls(None, metadata, attached_mode=True)

    # -- reading ------------------------------------------------------------------------------

    def served(self) -> Served:
        if self._served is None:
            raise self.detached_error()
        return self._served

    def current(self) -> KVPool:
        """The registered pool; :class:`EngineDetached` while none is."""
        return self.served().pool

    @property
    def registered(self) -> bool:
        return self._served is not None

    @property
    def metadata(self) -> bytes:
        """This agent's NIXL metadata as of the last (de)registration."""
        return self._metadata

    def detached_error(self) -> EngineDetached:
        ago = time.time() - self._since
        if self.state is SlotState.REGISTERING:
            return EngineDetached(
                "the engine is attaching its KV pool right now; its regions are not registered yet",
                fix="retry in a moment",
            )
        return EngineDetached(
            f"this daemon serves no KV pool: {self._why} ({ago:.1f}s ago); its regions are not"
            " registered with NIXL and a (re-)attach by the engine is awaited",
            fix="retry once the engine has re-attached (Describe on its engine socket shows"
            " REGISTERED); requests held before the detach were released and must be"
            " prefilled again",
        )

    # -- changing (kvxferd.daemon.attach only) -----------------------------------------------

    def begin(self) -> None:
        self.state = SlotState.REGISTERING

    def abort(self, why: str) -> None:
        self.state = SlotState.DETACHED
        self._why = why
        self._since = time.time()

    def fill(self, served: Served, metadata: bytes) -> int:
        """Serve ``served``; returns the new registration generation."""
        self._served = served
        self._metadata = metadata
        self.generation += 1
        self.state = SlotState.REGISTERED
        return self.generation

    def empty(self, why: str) -> Served:
        """Stop serving (``why``: what happened, for refusals); returns what was served."""
        served = self.served()
        self._served = None
        self.generation += 1
        self.state = SlotState.DETACHED
        self._why = why
        self._since = time.time()
        return served

    def set_metadata(self, metadata: bytes) -> None:
        self._metadata = metadata
