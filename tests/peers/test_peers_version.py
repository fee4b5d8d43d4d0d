"""The protocol version and the compatibility digest."""

from __future__ import annotations

import dataclasses
import re

from peers_specs import attn

from kvxferd.layout import KVDType, Layout, MemoryType, preset
from kvxferd.peers import PROTOCOL_VERSION, compat_digest


def test_protocol_version_is_two() -> None:
    assert PROTOCOL_VERSION == 2


def test_digest_is_short_hex_and_deterministic() -> None:
    d = compat_digest(attn())
    assert re.fullmatch(r"[0-9a-f]{16}", d)
    assert compat_digest(attn()) == d


def test_digest_covers_what_must_match() -> None:
    base = compat_digest(attn())
    changed = [
        attn(model="other"),
        attn(dtypes={2: KVDType.FP8_E4M3}),
        attn(layout=Layout.NHD),
        attn(head_size=128),
        attn(layers=3),
    ]
    spec = attn()
    renamed = dataclasses.replace(
        spec, regions=(dataclasses.replace(spec.regions[0], name="x"), *spec.regions[1:])
    )
    reordered = dataclasses.replace(spec, regions=spec.regions[::-1])
    digests = {compat_digest(s) for s in [*changed, renamed, reordered]}
    assert base not in digests and len(digests) == 7
    # kernel block sizes may differ between compatible peers (pulls re-block)
    assert compat_digest(attn(block=32)) == base
    assert compat_digest(spec, protocol_version=PROTOCOL_VERSION + 1) != base


def test_digest_ignores_what_may_differ() -> None:
    base = compat_digest(attn())
    assert compat_digest(attn(num_blocks=7)) == base
    assert compat_digest(attn().with_memory(MemoryType.VRAM)) == base
    assert compat_digest(attn(heads=2)) == base  # KV heads per rank vary with TP
    nhd = attn(layout=Layout.NHD)
    assert compat_digest(nhd, include_layout=False) == compat_digest(attn(), include_layout=False)
    # Logical block sizes (ppl) and a Mamba group's block sizes vary with TP in hybrids.
    assert compat_digest(preset("hybrid:num_blocks=2,ppl=34")) == compat_digest(
        preset("hybrid:num_blocks=2,ppl=66")
    )
