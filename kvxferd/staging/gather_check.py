"""What a Gather may ask for: kernel block IDs inside the pool, one list per KV cache group,
each ID held under the request's lease (nothing outside the pool, and nothing not leased, is
ever copied). Pure: no ring, no device."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvxferd.blocks import check_block_ids
from kvxferd.errors import InvalidRequest, LeaseRefused
from kvxferd.layout.spec import KVCacheSpec
from kvxferd.staging.device import Int64Array


def check_gather(
    spec: KVCacheSpec,
    blocks: tuple[Int64Array, ...] | None,
    request_id: str,
    kernel_ids: Sequence[Sequence[int]],
    *,
    max_block_ids: int,
) -> list[Int64Array]:
    """``kernel_ids`` as arrays, one per group, once each ID is inside the pool and held under
    ``request_id`` (``blocks``: its lease's kernel blocks per group, None when not held)."""
    if blocks is None:
        raise LeaseRefused(
            f"request {request_id!r} is not held here (never held, released or expired)",
            field="request_id",
            fix="gather only requests confirmed with ConfirmLease, before their lease ends",
        )
    if len(kernel_ids) != len(spec.groups):
        raise InvalidRequest(
            f"{len(kernel_ids)} block-ID lists for {len(spec.groups)} KV cache groups",
            field="kernel_block_ids.groups",
            fix="send one list per group (empty for none), in the spec's group order",
        )
    out: list[Int64Array] = []
    for g, ids in enumerate(kernel_ids):
        where = f"kernel_block_ids.groups[{g}]"
        arr = check_block_ids(ids, spec.num_kernel_blocks(g), where, max_ids=max_block_ids)
        held = blocks[g] if g < len(blocks) else arr[:0]
        outside = arr[~np.isin(arr, held)]
        if outside.size:
            raise LeaseRefused(
                f"kernel block IDs {outside[:8].tolist()} of group {g} are not held under"
                f" request {request_id!r} ({outside.size} ID(s))",
                field=where,
                fix="gather only the remote kernel blocks of the held request",
            )
        out.append(arr)
    return out


def check_chunk_bytes(total: int, chunk_bytes: int) -> None:
    """A chunk of ``total`` bytes must be non-empty and fit a ``chunk_bytes`` slot."""
    if total == 0:
        raise InvalidRequest(
            "nothing to gather: every group's list is empty", field="kernel_block_ids"
        )
    if total > chunk_bytes:
        raise InvalidRequest(
            f"the chunk is {total} bytes, a staging slot here holds {chunk_bytes}",
            field="kernel_block_ids",
            fix="cut chunks by the chunk_bytes this daemon advertises in its handshake",
        )


__all__ = ["check_chunk_bytes", "check_gather"]
