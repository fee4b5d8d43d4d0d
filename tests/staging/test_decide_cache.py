"""decide() prepares what depends only on the two specs, TP sizes, rings and peer once: the
cached answer is the direct one, never another spec's (ids are not trusted alone), and the
cache stays bounded."""

from __future__ import annotations

import gc

from kvxferd.blocks import plan_pull
from kvxferd.layout import preset
from kvxferd.layout.spec import KVCacheSpec, MemoryType
from kvxferd.staging import setup
from kvxferd.staging.chunks import RingInfo
from kvxferd.staging.ring import StagingRing
from kvxferd.staging.setup import Staging, decide
from kvxferd.staging.strategy import (
    CostModel,
    Mode,
    Strategy,
    group_row_bytes,
    staged_ineligible,
)

DENSE = "dense:num_blocks=16,num_layers=4,num_kv_heads=2,head_size=16,block_size=4"


def _direct(
    local: KVCacheSpec, remote: KVCacheSpec, ring: RingInfo | None, peer: str = "p:1"
) -> tuple[str | None, tuple[int, ...]]:
    why = staged_ineligible(
        local,
        remote,
        local_tp_size=1,
        remote_tp_size=1,
        local_ring=ring,
        remote_ring=ring,
        peer=peer,
    )
    return why, tuple(group_row_bytes(local))


def _cached(
    local: KVCacheSpec, remote: KVCacheSpec, ring: RingInfo | None, peer: str = "p:1"
) -> tuple[str | None, tuple[int, ...]]:
    return setup._pair_facts(
        ring, ring, local, remote, local_tp_size=1, remote_tp_size=1, peer=peer
    )


def test_cached_facts_equal_the_direct_ones_for_every_pair() -> None:
    ring = RingInfo(0, 1 << 20, 4, 0)
    small = RingInfo(0, 1024, 4, 0)
    specs = [preset(DENSE), preset(DENSE + ",layout=HND"), preset("hybrid"), preset("fp8")]
    for _ in range(2):  # second round: from the cache
        for a in specs:
            for b in specs:
                for r in (ring, small, None):
                    for peer in ("p:1", "p:2"):
                        assert _cached(a, b, r, peer) == _direct(a, b, r, peer)


def test_an_entry_is_used_only_for_its_own_spec_objects() -> None:
    ring = RingInfo(0, 1 << 20, 4, 0)
    a, hnd = preset(DENSE), preset(DENSE + ",layout=HND")
    assert _cached(a, a, ring)[0] is None
    # Forge the hazard: an entry under another spec's id (as if the id had been reused).
    key = (id(hnd), id(a), 1, 1, ring, ring, "p:1")
    setup._PAIRS[key] = (a, a, None, (123,))
    try:
        assert _cached(hnd, a, ring) == _direct(hnd, a, ring)
        assert _cached(hnd, a, ring)[0] is not None  # HND vs NHD: not STAGED
    finally:
        setup._PAIRS.pop(key, None)


def test_cache_is_bounded_and_holds_its_specs() -> None:
    ring = RingInfo(0, 1 << 20, 4, 0)
    for n in range(setup._MAX_PAIRS + 10):
        s = preset(f"{DENSE},num_layers={1 + n % 7}")
        assert _cached(s, s, ring) == _direct(s, s, ring)
        assert len(setup._PAIRS) <= setup._MAX_PAIRS
    gc.collect()
    for (lid, rid, *_), (local, remote, *_) in setup._PAIRS.items():
        assert (lid, rid) == (id(local), id(remote))


def test_decide_uses_the_current_specs_and_rings() -> None:
    four, two = preset(DENSE), preset(DENSE + ",num_layers=2")
    ring = StagingRing.allocate(group_row_bytes(four)[0] * 8, 2, "cpu")
    staging = Staging(Mode.STAGED, CostModel.defaults(MemoryType.DRAM), ring=ring)

    def run(spec: KVCacheSpec, remote_ring: RingInfo | None) -> setup.Decision:
        plan = plan_pull(spec, spec, [list(range(4))], [list(range(8, 12))], prefix_caching=False)
        return decide(
            staging,
            local=spec,
            remote=spec,
            local_tp_size=1,
            remote_tp_size=1,
            remote_ring=remote_ring,
            plan=plan,
            part=plan.per_rank[0],
            peer="p:1",
        )

    for _ in range(2):
        for spec in (four, two, preset(DENSE)):
            d = run(spec, ring.info)
            assert d.choice.strategy is Strategy.STAGED
            assert sum(c.nbytes for c in d.chunks) == 4 * group_row_bytes(spec)[0]
            d = run(spec, None)
            assert d.choice.strategy is Strategy.DIRECT and not d.chunks
            assert "p:1 advertises no staging ring" in d.choice.reason
