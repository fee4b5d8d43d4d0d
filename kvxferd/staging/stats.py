"""Per-pull stage timing of a STAGED pull (summed over chunks; chunks overlap)."""

from __future__ import annotations

from dataclasses import dataclass


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
