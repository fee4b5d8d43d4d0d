"""The wire codec (kvxferd.wire.codec) under generated input, without daemons.

Every spec a peer or an engine sends goes through ``spec_from_proto``: it must either refuse
with a kvxferd error naming the field or return a spec whose every size fits the int64 tables
the daemon builds from it (a block stride of 2^63 in a peer's handshake answer used to end in
INTERNAL "Python int too large to convert to C long" when the reader planned a pull).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxferd.errors import KvxferdError, SpecError
from kvxferd.layout.presets import preset
from kvxferd.v1 import common_pb2, spec_pb2
from kvxferd.wire.codec import (
    INT64_MAX,
    group_ids_from_proto,
    group_ids_to_proto,
    spec_from_proto,
    spec_to_proto,
)
from tests.fuzz import protofuzz as pf

PRESETS = (
    "dense:num_blocks=4,num_layers=2",
    "mla:num_blocks=4,num_layers=2",
    "hybrid:num_blocks=2,attention_layers=1,mamba_layers=1",
    "fp8:num_blocks=4,full_layers=1,sliding_layers=1",
    "dense:num_blocks=64",
)
SPECS = [spec_to_proto(preset(p)) for p in PRESETS]
specs = st.one_of(
    pf.mutated(lambda: SPECS),
    pf.mutated(lambda: SPECS),
    pf.messages(spec_pb2.KvCacheSpec.DESCRIPTOR),
)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(specs)
def test_spec_from_proto_refuses_cleanly_or_returns_int64_sizes(msg: spec_pb2.KvCacheSpec) -> None:
    try:
        spec = spec_from_proto(msg, "payload.spec")
    except KvxferdError as err:
        assert str(err)
        return
    for r in spec.regions:
        assert 0 < r.nbytes <= INT64_MAX
        assert all(0 < d <= INT64_MAX for d in r.shape)
        assert r.stride <= INT64_MAX
    # What was accepted encodes back to a spec that decodes to the same value.
    assert spec_from_proto(spec_to_proto(spec)) == spec


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda m: setattr(m.regions[0], "block_stride", 2**63), "spec.regions[0].block_stride"),
        (
            lambda m: setattr(m.regions[1], "block_stride", 2**64 - 1),
            "spec.regions[1].block_stride",
        ),
        (lambda m: m.regions[0].shape.__setitem__(0, 2**63), "spec.regions[0].shape[0]"),
        (lambda m: m.regions[2].shape.__setitem__(4, 2**64 - 1), "spec.regions[2].shape[4]"),
        # Each value fits, the region they describe does not: 64 blocks 2^62 bytes apart.
        (lambda m: setattr(m.regions[0], "block_stride", 2**62), "spec.regions[0]"),
    ],
)
def test_sizes_beyond_int64_are_refused_naming_the_field(mutate: object, field: str) -> None:
    msg = spec_pb2.KvCacheSpec()
    msg.CopyFrom(SPECS[-1])
    mutate(msg)  # type: ignore[operator]
    with pytest.raises(SpecError) as ei:
        spec_from_proto(msg)
    assert ei.value.field == field
    assert "2^63" in str(ei.value)


def test_a_real_spec_still_decodes() -> None:
    for msg, name in zip(SPECS, PRESETS, strict=True):
        assert spec_from_proto(msg) == preset(name)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20), max_size=4))
def test_group_ids_round_trip(groups: list[list[int]]) -> None:
    msg = group_ids_to_proto(groups)
    again = common_pb2.GroupBlockIds.FromString(msg.SerializeToString())
    assert [a.tolist() for a in group_ids_from_proto(again)] == groups
