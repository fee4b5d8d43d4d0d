"""The block IDs the demo's two engines hand out: one allocator per KV cache group on each side
(decode blocks are reused least recently freed first, like an engine's free list; prefill blocks
are not), and the prefill IDs a request holds until the prefill daemon releases them.
"""

from __future__ import annotations

from collections.abc import Container

import numpy as np

from kvxferd.layout.spec import KVCacheSpec
from kvxferd.scenario.mix import BlockAllocator, Int64Array, RequestShape, geometry

IdLists = list[Int64Array]


class EnginePools:
    """Allocators of the decode (``local``) and prefill (``remote``) pools."""

    def __init__(
        self, local_spec: KVCacheSpec, remote_spec: KVCacheSpec, rng: np.random.Generator
    ) -> None:
        self.local_geo = geometry(local_spec)
        self.remote_geo = geometry(remote_spec)
        self.local = [
            BlockAllocator(local_spec.num_logical_blocks(g), rng)
            for g in range(len(local_spec.groups))
        ]
        self.remote = [
            BlockAllocator(remote_spec.num_logical_blocks(g), rng, lru=False)
            for g in range(len(remote_spec.groups))
        ]
        self.held: dict[str, IdLists] = {}  # request ID -> prefill IDs, until released

    def allocate(self, shape: RequestShape) -> tuple[IdLists, IdLists] | None:
        """(local, remote) logical block IDs per group for ``shape``, or None (nothing taken)
        when either pool has no room."""
        r_counts = shape.remote_counts(self.remote_geo)
        l_counts = shape.local_counts(self.local_geo, self.remote_geo)
        remote: IdLists = []
        local: IdLists = []
        for g, n in enumerate(r_counts):
            ids = self.remote[g].take(n, shape.pattern)
            if ids is None:
                break
            remote.append(ids)
        if len(remote) == len(r_counts):
            for g, n in enumerate(l_counts):
                ids = self.local[g].take(n, shape.pattern)
                if ids is None:
                    break
                local.append(ids)
        if len(remote) == len(r_counts) and len(local) == len(l_counts):
            return local, remote
        self.free_remote(remote)
        self.free_local(local)
        return None

    def take_local_like(self, old: IdLists, pattern: str) -> IdLists | None:
        """Other decode IDs, as many per group as ``old``, or None (nothing taken)."""
        alt: IdLists = []
        for g, ids in enumerate(old):
            got = self.local[g].take(int(ids.size), pattern)
            if got is None:
                self.free_local(alt)
                return None
            alt.append(got)
        return alt

    def free_local(self, local: IdLists) -> None:
        for g, ids in enumerate(local):
            self.local[g].release(ids)

    def free_remote(self, remote: IdLists) -> None:
        for g, ids in enumerate(remote):
            self.remote[g].release(ids)

    def hold(self, request_id: str, remote: IdLists) -> None:
        self.held[request_id] = remote

    def reclaim(self, released: Container[str]) -> None:
        """Give back the prefill IDs of every held request in ``released``."""
        for rid in [r for r in self.held if r in released]:
            self.release_held(rid)

    def release_held(self, request_id: str) -> None:
        self.free_remote(self.held.pop(request_id))
