"""The harness's pure parts: the owner's byte pattern and block digests, the check of pulled
blocks against their sources, and the demo's block bookkeeping of the two engines."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.layout import preset
from kvxferd.scenario.demo_pools import EnginePools
from kvxferd.scenario.digests import any_preloaded, check_pulled, zero_digest
from kvxferd.scenario.mix import CONTIGUOUS, FRAGMENTED, request_mix
from kvxferd.scenario.pattern import block_digests, fill_pattern, pattern_words, region_rows

WORD = 8


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 255),
    region=st.integers(0, 255),
    words=st.integers(1, 4096),
)
def test_fill_writes_exactly_the_pattern_words(seed: int, region: int, words: int) -> None:
    buf = torch.zeros(words * WORD, dtype=torch.uint8)
    fill_pattern(buf, seed, region)
    assert np.array_equal(buf.view(torch.int64).numpy(), pattern_words(seed, region, 0, words))


@given(
    seed=st.integers(0, 255),
    first=st.integers(0, 1 << 40),
    count=st.integers(1, 512),
)
def test_pattern_words_tell_seed_region_and_offset_apart(seed: int, first: int, count: int) -> None:
    words = pattern_words(seed, 0, first, count)
    assert len(set(words.tolist())) == count  # no two offsets alike
    assert not np.array_equal(words, pattern_words(seed, 1, first, count))  # region
    assert not np.array_equal(words, pattern_words(seed + 1, 0, first, count))  # seed
    assert not np.array_equal(words, pattern_words(seed, 0, first + 1, count))  # a shift


def test_pattern_words_continue_across_chunks() -> None:
    whole = pattern_words(3, 2, 0, 1000)
    parts = np.concatenate([pattern_words(3, 2, 0, 300), pattern_words(3, 2, 300, 700)])
    assert np.array_equal(whole, parts)


@settings(max_examples=30, deadline=None)
@given(
    block_words=st.integers(1, 64),
    blocks=st.lists(st.integers(0, 15), min_size=1, max_size=16),
)
def test_block_digests_hash_each_block_alone(block_words: int, blocks: list[int]) -> None:
    bb = block_words * WORD
    buf = torch.zeros(16 * bb, dtype=torch.uint8)
    fill_pattern(buf, 5, 1)
    got = block_digests(buf, blocks, bb)
    raw = buf.numpy().tobytes()
    want = [hashlib.blake2b(raw[b * bb : (b + 1) * bb], digest_size=8).hexdigest() for b in blocks]
    assert got == want


def test_region_rows_are_address_bytes_device() -> None:
    ts = [torch.zeros(64, dtype=torch.uint8), torch.zeros(16, dtype=torch.int64)]
    rows = region_rows(ts)
    assert rows.tolist() == [[ts[0].data_ptr(), 64, 0], [ts[1].data_ptr(), 128, 0]]


def test_zero_digest_is_the_digest_of_a_zeroed_block_over_the_group_regions() -> None:
    spec = preset("dense", num_blocks=4)
    h = hashlib.blake2b(digest_size=8)
    for r in spec.regions_of(0):
        h.update(bytes(r.block_len))
    assert zero_digest(spec, 0) == h.digest()


digest = st.binary(min_size=1, max_size=2)


@given(data=st.data(), n=st.integers(0, 24))
def test_check_pulled_counts_add_up(data: st.DataObject, n: int) -> None:
    zero = b"\x00"
    expected = data.draw(st.lists(digest, min_size=n, max_size=n))
    before = data.draw(st.lists(digest, min_size=n, max_size=n))
    after = data.draw(st.lists(digest, min_size=n, max_size=n))
    c = check_pulled(after, expected, before, zero)
    equal = [i for i in range(n) if after[i] == expected[i]]
    assert sorted(c.differ + equal) == list(range(n))
    assert c.verified == sum(1 for i in equal if expected[i] != zero)
    assert c.verified + len([i for i in c.blank if i in equal]) == len(equal)
    assert c.changed == sum(1 for i in range(n) if after[i] != before[i])
    assert (c.preloaded > 0) == any_preloaded([before], [expected])
    assert 0 <= c.ambiguous <= n and c.ambiguous != 1  # a duplicate comes with its twin


def test_check_pulled_names_a_wrong_block_and_a_never_written_source() -> None:
    zero = b"z"
    c = check_pulled([b"a", b"x", b"z"], [b"a", b"b", b"z"], [b"0", b"0", b"0"], zero)
    assert c.differ == [1]
    assert c.blank == [2]
    assert (c.verified, c.changed, c.preloaded, c.ambiguous) == (1, 3, 0, 0)


def test_check_pulled_refuses_lists_of_different_lengths() -> None:
    with pytest.raises(ValueError):
        check_pulled([b"a"], [b"a", b"b"], [b"a", b"b"], b"z")


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 1000), requests=st.integers(1, 12))
def test_engine_pools_hand_out_disjoint_ids_and_take_them_back(seed: int, requests: int) -> None:
    spec = preset("hybrid", num_blocks=32)
    pools = EnginePools(spec, spec, np.random.default_rng(seed))
    free = [a.free_count for a in pools.local], [a.free_count for a in pools.remote]
    shapes = request_mix(
        requests, local=pools.local_geo, remote=pools.remote_geo, prefix_caching=False, seed=seed
    )
    taken: list[tuple[str, list[np.ndarray], list[np.ndarray]]] = []
    for i, shape in enumerate(shapes):
        got = pools.allocate(shape)
        if got is None:  # no room: nothing was taken
            continue
        local, remote = got
        pools.hold(f"r{i}", remote)
        taken.append((f"r{i}", local, remote))
    for g in range(len(spec.groups)):
        for side in (1, 2):
            ids = np.concatenate([t[side][g] for t in taken]) if taken else np.zeros(0)
            assert len(set(ids.tolist())) == ids.size  # never handed out twice
    for _, local, _ in taken:
        pools.free_local(local)
    pools.reclaim({rid for rid, _, _ in taken})
    assert not pools.held
    assert ([a.free_count for a in pools.local], [a.free_count for a in pools.remote]) == free


def test_take_local_like_takes_nothing_when_a_group_has_no_room() -> None:
    spec = preset("dense", num_blocks=16)
    pools = EnginePools(spec, spec, np.random.default_rng(0))
    first = [pools.local[0].take(12, CONTIGUOUS)]
    assert first[0] is not None
    assert pools.take_local_like([np.arange(8)], FRAGMENTED) is None
    assert pools.local[0].free_count == 4  # the failed take left nothing behind
    other = pools.take_local_like([np.arange(4)], FRAGMENTED)
    assert other is not None and not set(other[0].tolist()) & set(first[0].tolist())
