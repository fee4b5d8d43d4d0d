"""Checksums that prove a pull: the daemons' ``Checksum`` digests of kernel blocks, per group,
and the digest of a never-written (zeroed) block, which a pulled block must not have.

The daemon hashes a kernel block as BLAKE2b (8 bytes) over the block's bytes in every region of
its group, in region order; :func:`zero_digest` computes the same for zero bytes without a
daemon. :func:`pattern.block_digests <kvxferd.scenario.pattern.block_digests>` is the
in-process counterpart for memory this process holds.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvxferd.layout.spec import KVCacheSpec
from kvxferd.scenario.client import DaemonClient
from kvxferd.scenario.mix import Int64Array

DIGEST_SIZE = 8


def daemon_digests(client: DaemonClient, kernel_ids: tuple[Int64Array, ...]) -> list[list[bytes]]:
    """Checksum of every group's kernel blocks (an empty list for a group with none)."""
    return [client.checksum(g, ids) if ids.size else [] for g, ids in enumerate(kernel_ids)]


def zero_digest(spec: KVCacheSpec, group: int) -> bytes:
    """The Checksum digest of a never-written (zeroed) kernel block of ``group``."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for r in spec.regions_of(group):
        h.update(bytes(r.block_len))
    return h.digest()


@dataclass(frozen=True)
class BlockCheck:
    """One group's pulled kernel blocks checked against their sources (indices into the
    plan's pairs)."""

    verified: int  # equal to the source, and the source is not a never-written block
    changed: int  # differ from what the decode block held before the pull
    preloaded: int  # already held the source's bytes before the pull (the write is unproven)
    ambiguous: int  # share their source digest with another block of the request
    differ: list[int]  # not equal to the source: the pull is wrong
    blank: list[int]  # the source reads as never written: the prefill pool was not filled


def check_pulled(
    after: Sequence[bytes], expected: Sequence[bytes], before: Sequence[bytes], zero: bytes
) -> BlockCheck:
    """Compare digests after a pull with the sources' (``expected``) and with ``before``."""
    pairs = list(zip(after, expected, strict=True))
    dupes = Counter(expected)
    return BlockCheck(
        verified=sum(1 for a, e in pairs if a == e and e != zero),
        changed=sum(1 for a, b in zip(after, before, strict=True) if a != b),
        preloaded=sum(1 for b, e in zip(before, expected, strict=True) if b == e),
        ambiguous=sum(1 for d in expected if dupes[d] > 1),
        differ=[i for i, (a, e) in enumerate(pairs) if a != e],
        blank=[i for i, e in enumerate(expected) if e == zero],
    )


def any_preloaded(before: Sequence[Sequence[bytes]], expected: Sequence[Sequence[bytes]]) -> bool:
    """Whether any decode block already holds its source's bytes (per group, in plan order)."""
    return any(
        b == e for bg, eg in zip(before, expected, strict=True) for b, e in zip(bg, eg, strict=True)
    )
