"""Per-pull stage timing of a STAGED pull (summed over chunks; chunks overlap), and a staging
ring's occupancy."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StageTimes:
    """A STAGED pull's stage times, summed over its chunks (chunks overlap, so the sums can
    exceed the pull's time). ``gather_rpc_s``: per chunk, from the moment the reader could get
    it (the Gather sent; over a Stage stream: the credit allowing it given back, or the previous
    announcement, whichever came later) to its slot being answered or announced. Over a Stage
    stream (``stream``), the per-chunk *control cost* is ``control_s + owner_start_s``: reader
    side, announcement arrived -> READ posted (less ``slot_wait_s``); owner side, credit
    arrived -> gather started (less ``owner_slot_wait_s``)."""

    chunks: int = 0
    gather_s: float = 0.0
    gather_rpc_s: float = 0.0
    read_s: float = 0.0
    scatter_s: float = 0.0
    slot_wait_s: float = 0.0
    stream: bool = False
    control_s: float = 0.0
    owner_start_s: float = 0.0
    owner_slot_wait_s: float = 0.0

    @property
    def control_per_chunk_s(self) -> float:
        return (self.control_s + self.owner_start_s) / self.chunks if self.chunks else 0.0

    def as_log(self) -> dict[str, float]:
        out = {
            "chunks": self.chunks,
            "gather_ms": round(self.gather_s * 1e3, 3),
            "gather_rpc_ms": round(self.gather_rpc_s * 1e3, 3),
            "read_ms": round(self.read_s * 1e3, 3),
            "scatter_ms": round(self.scatter_s * 1e3, 3),
            "slot_wait_ms": round(self.slot_wait_s * 1e3, 3),
        }
        if self.stream:
            out |= {
                "stream": 1,
                "control_ms": round(self.control_s * 1e3, 3),
                "owner_start_ms": round(self.owner_start_s * 1e3, 3),
                "owner_slot_wait_ms": round(self.owner_slot_wait_s * 1e3, 3),
                "control_per_chunk_us": round(self.control_per_chunk_s * 1e6, 1),
            }
        return out


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
