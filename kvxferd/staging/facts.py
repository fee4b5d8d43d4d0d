"""What :func:`kvxferd.staging.setup.decide` derives once per peer generation: whether STAGED
can serve pulls between this daemon's pool and the peer's (its spec, TP size and ring), and the
local pool's group row bytes that cut a STAGED pull into chunks.

A :class:`PairFacts` lives on the peer generation's
:class:`~kvxferd.daemon.handshake.RemoteDescription`, which every handshake builds anew: a
restarted or re-registered peer starts with none, and the facts are freed with the description.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxferd.layout.spec import KVCacheSpec
from kvxferd.staging.chunks import RingInfo
from kvxferd.staging.strategy import group_row_bytes, staged_ineligible

Facts = tuple[str | None, tuple[int, ...]]  # (why not STAGED, or None; local group row bytes)


def pair_facts(
    local_ring: RingInfo | None,
    remote_ring: RingInfo | None,
    local: KVCacheSpec,
    remote: KVCacheSpec,
    *,
    local_tp_size: int,
    remote_tp_size: int,
    peer: str,
) -> Facts:
    """``staged_ineligible(...)`` and ``group_row_bytes(local)``, computed."""
    why = staged_ineligible(
        local,
        remote,
        local_tp_size=local_tp_size,
        remote_tp_size=remote_tp_size,
        local_ring=local_ring,
        remote_ring=remote_ring,
        peer=peer,
    )
    return why, tuple(group_row_bytes(local))


@dataclass(eq=False)
class PairFacts:
    """:func:`pair_facts` for one peer generation, kept while its inputs stay the same objects.

    One entry: a generation meets one local pool at a time. Its inputs are compared by identity
    (the specs and rings a generation and a pool hold for life) and by value (TP sizes, peer);
    anything else (this daemon's engine re-attached with another pool) computes afresh and
    replaces the entry."""

    _inputs: tuple[object, ...] = ()
    _facts: Facts | None = None
    computed: int = 0  # how often the facts were computed (a hit costs no computation)

    def get(
        self,
        local_ring: RingInfo | None,
        remote_ring: RingInfo | None,
        local: KVCacheSpec,
        remote: KVCacheSpec,
        *,
        local_tp_size: int,
        remote_tp_size: int,
        peer: str,
    ) -> Facts:
        """The same as :func:`pair_facts` with these arguments."""
        i = self._inputs
        if (
            self._facts is not None
            and i[0] is local
            and i[1] is remote
            and i[2] is local_ring
            and i[3] is remote_ring
            and i[4] == local_tp_size
            and i[5] == remote_tp_size
            and i[6] == peer
        ):
            return self._facts
        facts = pair_facts(
            local_ring,
            remote_ring,
            local,
            remote,
            local_tp_size=local_tp_size,
            remote_tp_size=remote_tp_size,
            peer=peer,
        )
        self._inputs = (local, remote, local_ring, remote_ring, local_tp_size, remote_tp_size, peer)
        self._facts = facts
        self.computed += 1
        return facts
