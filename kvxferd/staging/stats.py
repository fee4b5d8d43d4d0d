"""Per-pull stage timing of a STAGED pull (summed over chunks; chunks overlap), and a staging
ring's occupancy."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StageTimes:
    chunks: int = 0
    gather_s: float = 0.0
    gather_rpc_s: float = 0.0
    read_s: float = 0.0
    scatter_s: float = 0.0
    slot_wait_s: float = 0.0

    def as_log(self) -> dict[str, float]:
        return {
            "chunks": self.chunks,
            "gather_ms": round(self.gather_s * 1e3, 3),
            "gather_rpc_ms": round(self.gather_rpc_s * 1e3, 3),
            "read_ms": round(self.read_s * 1e3, 3),
            "scatter_ms": round(self.scatter_s * 1e3, 3),
            "slot_wait_ms": round(self.slot_wait_s * 1e3, 3),
        }


@dataclass(frozen=True)
class Occupancy:
    """A staging ring's slots at one moment, as its owner side sees them (for metrics).

    ``granted`` counts the owner-side grants per reader identity (readers holding none are
    left out), ``waiting`` the Gathers queued per reader; ``local`` is the slots this daemon's
    own STAGED pulls use (reader side). ``slots = free + sum(granted) + local``."""

    slots: int
    free: int
    reader_cap: int
    granted: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    local: int = 0

    @property
    def granted_total(self) -> int:
        return sum(self.granted.values())

    @property
    def waiting_total(self) -> int:
        return sum(self.waiting.values())
