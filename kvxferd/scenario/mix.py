"""The demo's request mix and the block allocators that place it (pure, seeded).

A request is a prompt length plus what the decode side already holds (a prefix-cache hit).
Its block-ID lists per KV cache group follow from each side's spec, the way an engine sizes
them:

* attention-like groups: ``ceil(tokens / logical_block_size)`` logical blocks on each side
  (with different ``ppl`` the two sides then differ by less than one logical block, which the
  planner pairs by keeping the first common kernel blocks);
* state (Mamba) groups: one state per request on each side;
* a prefix hit of ``h`` blocks: the decode side lists ``h`` fewer blocks of each attention
  group (the planner end-trims the remote list); a full hit lists none at all, state groups
  included.

:class:`BlockAllocator` hands out one group's logical block IDs on one side, as an engine's
allocator would: a contiguous run or a shuffled scatter, least recently used blocks first so
that a pulled block has, as far as the pool allows, never been written before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxferd.layout.spec import KVCacheSpec

Int64Array = npt.NDArray[np.int64]

CONTIGUOUS = "contiguous"
FRAGMENTED = "fragmented"
PATTERNS = (CONTIGUOUS, FRAGMENTED)

SHORT, MEDIUM, LONG, PREFIX_HIT, FULL_HIT = "short", "medium", "long", "prefix hit", "full hit"

# The cycle of (kind, block-ID pattern) requests follow; the first six cover every case.
CYCLE_PREFIX_CACHING: tuple[tuple[str, str], ...] = (
    (SHORT, CONTIGUOUS),
    (LONG, FRAGMENTED),
    (PREFIX_HIT, FRAGMENTED),
    (SHORT, FRAGMENTED),
    (LONG, CONTIGUOUS),
    (FULL_HIT, CONTIGUOUS),
    (MEDIUM, FRAGMENTED),
    (PREFIX_HIT, CONTIGUOUS),
)
CYCLE_NO_PREFIX_CACHING: tuple[tuple[str, str], ...] = (
    (SHORT, CONTIGUOUS),
    (LONG, FRAGMENTED),
    (MEDIUM, CONTIGUOUS),
    (SHORT, FRAGMENTED),
    (LONG, CONTIGUOUS),
    (MEDIUM, FRAGMENTED),
)
SHORT_MAX_TOKENS = 512


@dataclass(frozen=True)
class GroupGeometry:
    """What sizing a request needs from one KV cache group of one side."""

    is_state: bool
    logical_block_size: int
    num_logical_blocks: int


def geometry(spec: KVCacheSpec) -> tuple[GroupGeometry, ...]:
    return tuple(
        GroupGeometry(g.kind.is_state, g.logical_block_size, spec.num_logical_blocks(i))
        for i, g in enumerate(spec.groups)
    )


@dataclass(frozen=True)
class RequestShape:
    """One request of the mix: ``tokens`` of prompt, ``cached_tokens`` already on the decode
    side (a multiple of the first group's logical block size), or all of it (``full_hit``)."""

    index: int
    kind: str
    pattern: str
    tokens: int
    cached_tokens: int = 0
    full_hit: bool = False

    def remote_counts(self, remote: Sequence[GroupGeometry]) -> list[int]:
        """Logical blocks (states) per group the prefill side holds."""
        return [1 if g.is_state else math.ceil(self.tokens / g.logical_block_size) for g in remote]

    def local_counts(
        self, local: Sequence[GroupGeometry], remote: Sequence[GroupGeometry]
    ) -> list[int]:
        """Logical blocks (states) per group the decode side asks to fill."""
        if self.full_hit:
            return [0] * len(local)
        out = []
        for lg, n_r in zip(local, self.remote_counts(remote), strict=True):
            if lg.is_state:
                out.append(1)
            elif self.cached_tokens:
                hit = min(self.cached_tokens // lg.logical_block_size, n_r - 1)
                out.append(n_r - hit)
            else:
                out.append(math.ceil(self.tokens / lg.logical_block_size))
        return out


def capacity_tokens(*sides: Sequence[GroupGeometry]) -> int:
    """Tokens the smallest attention group of any side can hold (the pool's prompt capacity)."""
    caps = [g.num_logical_blocks * g.logical_block_size for s in sides for g in s if not g.is_state]
    if not caps:
        raise ValueError("the mix needs at least one attention-like KV cache group")
    return min(caps)


def request_mix(
    count: int,
    *,
    local: Sequence[GroupGeometry],
    remote: Sequence[GroupGeometry],
    prefix_caching: bool,
    seed: int,
) -> list[RequestShape]:
    """``count`` requests cycling through the kinds; every prompt fits in half the smaller pool,
    so two requests in flight always fit."""
    rng = np.random.default_rng(seed)
    cap = capacity_tokens(local, remote)
    unit = max(g.logical_block_size for s in (local, remote) for g in s if not g.is_state)
    first = next(g for g in remote if not g.is_state).logical_block_size
    half = max(1, cap // 2)

    def pick(lo: int, hi: int) -> int:
        hi = max(1, min(hi, half))
        lo = max(1, min(lo, hi))
        return int(rng.integers(lo, hi + 1))

    cycle = CYCLE_PREFIX_CACHING if prefix_caching else CYCLE_NO_PREFIX_CACHING
    out: list[RequestShape] = []
    for i in range(count):
        kind, pattern = cycle[i % len(cycle)]
        if kind == SHORT:
            shape = RequestShape(
                i, kind, pattern, pick(1, max(unit, min(SHORT_MAX_TOKENS, cap // 8)))
            )
        elif kind == MEDIUM:
            shape = RequestShape(i, kind, pattern, pick(cap // 8, cap // 4))
        elif kind == LONG:
            shape = RequestShape(i, kind, pattern, pick(cap // 4, cap // 2))
        elif kind == PREFIX_HIT:
            tokens = pick(max(2 * unit + 1, cap // 8), max(2 * unit + 1, cap // 4))
            blocks = math.ceil(tokens / first)
            hit = int(rng.integers(1, blocks)) if blocks > 1 else 0
            shape = RequestShape(i, kind, pattern, tokens, cached_tokens=hit * first)
        else:
            tokens = pick(unit + 1, max(unit + 1, cap // 8))
            shape = RequestShape(i, kind, pattern, tokens, full_hit=True)
        out.append(shape)
    return out


class BlockAllocator:
    """Free logical block IDs of one group on one side.

    ``lru=True`` (the decode side): never-used blocks first, then the least recently used, so a
    pulled block rarely already holds what it receives. ``lru=False`` (the prefill side, whose
    contents never change): uniformly random placement, so that the pairing of decode and
    prefill blocks does not repeat from one pass over the pools to the next.
    """

    def __init__(self, num_blocks: int, rng: np.random.Generator, *, lru: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.lru = lru
        self._rng = rng
        self._free = np.ones(num_blocks, dtype=bool)
        self._last = np.full(num_blocks, -1, dtype=np.int64)  # -1: never handed out
        self._tick = 0

    @property
    def free_count(self) -> int:
        return int(self._free.sum())

    def ever_used(self, ids: npt.ArrayLike) -> int:
        """How many of ``ids`` were handed out before (their contents may be a past pull's)."""
        return int((self._last[np.asarray(ids, dtype=np.int64)] >= 0).sum())

    def take(self, n: int, pattern: str) -> Int64Array | None:
        """``n`` free IDs (a run for ``contiguous``, a shuffled scatter for ``fragmented``), or
        None when they do not fit now. The IDs are marked used until :meth:`release`."""
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        if n > self.num_blocks:
            return None
        if pattern == CONTIGUOUS:
            ids = self._run(n)
        elif pattern == FRAGMENTED:
            ids = self._scatter(n)
        else:
            raise ValueError(f"unknown pattern {pattern!r}; use one of {PATTERNS}")
        if ids is not None:
            self._free[ids] = False
            self._last[ids] = self._tick
            self._tick += 1
        return ids

    def release(self, ids: npt.ArrayLike) -> None:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and self._free[arr].any():
            raise ValueError("releasing block IDs that are not allocated")
        self._free[arr] = True

    def _run(self, n: int) -> Int64Array | None:
        def window_sums(flags: npt.NDArray[np.bool_]) -> Int64Array:
            cs = np.concatenate(([0], np.cumsum(flags, dtype=np.int64)))
            sums: Int64Array = cs[n:] - cs[:-n]
            return sums

        valid = np.flatnonzero(window_sums(~self._free) == 0)
        if valid.size == 0:
            return None
        if not self.lru:
            start = int(self._rng.choice(valid))
            return np.arange(start, start + n, dtype=np.int64)
        fresh = valid[window_sums(self._last >= 0)[valid] == 0]
        if fresh.size:
            start = int(fresh[0])
        else:  # least recently used run among a sample of the candidates
            cand = self._rng.choice(valid, size=min(64, valid.size), replace=False)
            ages = [int(self._last[s : s + n].max()) for s in cand]
            start = int(cand[int(np.argmin(ages))])
        return np.arange(start, start + n, dtype=np.int64)

    def _scatter(self, n: int) -> Int64Array | None:
        free_ids = np.flatnonzero(self._free)
        if free_ids.size < n:
            return None
        ages = self._last[free_ids] if self.lru else np.zeros(free_ids.size, dtype=np.int64)
        order = np.lexsort((self._rng.random(free_ids.size), ages))
        picked = free_ids[order[:n]].astype(np.int64)
        out: Int64Array = self._rng.permutation(picked)
        return out
