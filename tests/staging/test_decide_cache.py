"""decide() derives what depends only on the two pools, TP sizes, rings and peer (STAGED
eligibility, the group row bytes) once per peer generation: the facts live on the generation's
RemoteDescription, equal the direct computation, are computed afresh for a new generation (a
restarted peer never meets its predecessor's facts) and are freed with the generation."""

from __future__ import annotations

import gc
import weakref

import numpy as np

from kvxferd.blocks import plan_pull
from kvxferd.daemon.handshake import RemoteDescription
from kvxferd.daemon.peers import PeerLink
from kvxferd.layout import preset
from kvxferd.layout.spec import KVCacheSpec, MemoryType
from kvxferd.peers import PeerInfo
from kvxferd.staging.chunks import RingInfo
from kvxferd.staging.facts import PairFacts, pair_facts
from kvxferd.staging.ring import StagingRing
from kvxferd.staging.setup import Decision, Staging, decide
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


def _get(
    facts: PairFacts,
    local: KVCacheSpec,
    remote: KVCacheSpec,
    ring: RingInfo | None,
    peer: str = "p:1",
) -> tuple[str | None, tuple[int, ...]]:
    return facts.get(ring, ring, local, remote, local_tp_size=1, remote_tp_size=1, peer=peer)


def test_facts_equal_the_direct_ones_for_every_pair() -> None:
    ring = RingInfo(0, 1 << 20, 4, 0)
    small = RingInfo(0, 1024, 4, 0)
    specs = [preset(DENSE), preset(DENSE + ",layout=HND"), preset("hybrid"), preset("fp8")]
    facts = PairFacts()
    for a in specs:
        for b in specs:
            for r in (ring, small, None):
                for peer in ("p:1", "p:2"):
                    want = _direct(a, b, r, peer)
                    assert _get(facts, a, b, r, peer) == want  # computed
                    assert _get(facts, a, b, r, peer) == want  # kept
                    direct = pair_facts(r, r, a, b, local_tp_size=1, remote_tp_size=1, peer=peer)
                    assert direct == want


def test_facts_are_kept_only_for_the_same_objects() -> None:
    ring = RingInfo(0, 1 << 20, 4, 0)
    a, hnd = preset(DENSE), preset(DENSE + ",layout=HND")
    facts = PairFacts()
    assert _get(facts, a, a, ring)[0] is None
    assert _get(facts, a, a, ring)[0] is None and facts.computed == 1
    assert _get(facts, hnd, a, ring) == _direct(hnd, a, ring)  # HND vs NHD: not STAGED
    assert _get(facts, hnd, a, ring)[0] is not None and facts.computed == 2
    again = preset(DENSE)  # equal to a, another object: computed, not assumed
    assert _get(facts, again, again, RingInfo(0, 1 << 20, 4, 0)) == _direct(a, a, ring)
    assert facts.computed == 3


def _generation(spec: KVCacheSpec, ring: RingInfo | None, instance: str) -> RemoteDescription:
    return RemoteDescription(
        info=PeerInfo(spec=spec, tp_rank=0, tp_size=1, prefix_caching=False),
        agent_name=f"owner-{instance}",
        agent_metadata=b"",
        regions=np.zeros((len(spec.regions), 3), dtype=np.int64),
        generation=1,
        daemon_id="d",
        instance_id=instance,
        address="p:1",
        staging=ring,
    )


def _pull(staging: Staging, spec: KVCacheSpec, link: PeerLink) -> Decision:
    assert link.remote is not None
    plan = plan_pull(spec, spec, [list(range(4))], [list(range(8, 12))], prefix_caching=False)
    return decide(
        staging,
        local=spec,
        remote=link.remote.info.spec,
        local_tp_size=1,
        remote_tp_size=link.remote.info.tp_size,
        remote_ring=link.remote.staging,
        plan=plan,
        part=plan.per_rank[0],
        peer=link.address,
        link=link,
    )


def test_a_new_peer_generation_gets_fresh_facts() -> None:
    spec = preset(DENSE)
    ring = StagingRing.allocate(group_row_bytes(spec)[0] * 8, 2, "cpu")
    staging = Staging(Mode.STAGED, CostModel.defaults(MemoryType.DRAM), ring=ring)
    link = PeerLink("p:1", client=None)  # type: ignore[arg-type]  # decide() reads no client
    first = link.remote = _generation(spec, RingInfo(0, 1 << 20, 4, 0), "i1")
    for _ in range(3):
        assert _pull(staging, spec, link).choice.strategy is Strategy.STAGED
    assert first.facts.computed == 1  # once for the generation, not per pull
    # The peer restarts without a staging ring, with the same spec text: a new generation.
    second = link.remote = _generation(preset(DENSE), None, "i2")
    assert second.facts.computed == 0
    d = _pull(staging, spec, link)
    assert d.choice.strategy is Strategy.DIRECT and "p:1 advertises no staging ring" in (
        d.choice.reason
    )
    assert second.facts.computed == 1 and first.facts.computed == 1
    # Freed with the generation: nothing module-wide holds the first one's facts.
    gone = weakref.ref(first.facts)
    del first
    gc.collect()
    assert gone() is None


def test_decide_without_a_link_uses_the_current_specs_and_rings() -> None:
    four, two = preset(DENSE), preset(DENSE + ",num_layers=2")
    ring = StagingRing.allocate(group_row_bytes(four)[0] * 8, 2, "cpu")
    staging = Staging(Mode.STAGED, CostModel.defaults(MemoryType.DRAM), ring=ring)

    def run(spec: KVCacheSpec, remote_ring: RingInfo | None) -> Decision:
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
