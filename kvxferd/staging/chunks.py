"""Staging geometry (pure): the ring a daemon advertises, and a pull cut into slot-sized chunks.

A STAGED pull moves, per KV group ``g``, ``n_g`` paired kernel blocks. One *row* of group ``g``
is one block of every region of ``g`` back to back (``row_bytes[g] = sum(block_len)``), the
staging layout of :mod:`kvxferd.kernels.geometry`. A chunk is a slice of rows of one or more
groups, in group order, that fits one slot:

    slot bytes:  [ group 0 rows a0..b0 | group 1 rows a1..b1 | ... ]   (<= chunk_bytes)

Both sides derive the same layout from the per-group row counts (:func:`span_offsets`), so the
owner's gather and the reader's scatter agree without sending offsets. Cutting is arithmetic:
``O(groups + chunks)``, never per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvxferd.errors import InvalidRequest


@dataclass(frozen=True)
class RingInfo:
    """A staging ring as its daemon advertises it: ``chunks`` slots of ``chunk_bytes`` bytes
    starting at ``base`` on ``device`` (0 for DRAM), registered with NIXL once."""

    base: int
    chunk_bytes: int
    chunks: int
    device: int
    stream: bool = False  # its daemon serves Peer.Stage (else: Gather and ReleaseStaging)

    @property
    def nbytes(self) -> int:
        return self.chunk_bytes * self.chunks

    def row(self) -> tuple[int, int, int]:
        """The ring's ``(addr, len, dev)`` registration row."""
        return (self.base, self.nbytes, self.device)

    def slot_offset(self, slot: int) -> int:
        if not 0 <= slot < self.chunks:
            raise InvalidRequest(
                f"staging slot {slot} does not exist; the ring has {self.chunks}",
                field="slot",
                fix="use a slot index a Gather response returned",
            )
        return slot * self.chunk_bytes


@dataclass(frozen=True)
class Span:
    """Rows ``[start, stop)`` of group ``group``'s paired block lists."""

    group: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Chunk:
    """One slot's worth of a pull: its spans in group order and their total bytes."""

    index: int
    spans: tuple[Span, ...]
    nbytes: int


def split_chunks(counts: Sequence[int], row_bytes: Sequence[int], chunk_bytes: int) -> list[Chunk]:
    """Cut ``counts[g]`` rows of ``row_bytes[g]`` bytes per group into chunks that fit
    ``chunk_bytes``; every row lands in exactly one chunk, in order. Raises
    :class:`InvalidRequest` when one row is larger than a slot."""
    if len(counts) != len(row_bytes):
        raise InvalidRequest(f"{len(counts)} group counts for {len(row_bytes)} row sizes")
    if chunk_bytes <= 0:
        raise InvalidRequest(f"chunk_bytes must be positive, got {chunk_bytes}")
    chunks: list[Chunk] = []
    spans: list[Span] = []
    used = 0
    for g, (n, rb) in enumerate(zip(counts, row_bytes, strict=True)):
        if n <= 0:
            continue
        if rb > chunk_bytes:
            raise InvalidRequest(
                f"a block row of group {g} is {rb} bytes, more than a staging slot"
                f" ({chunk_bytes} bytes)",
                field="transfer.staging_chunk_bytes",
                fix="raise transfer.staging_chunk_bytes on both daemons",
            )
        done = 0
        while done < n:
            fit = (chunk_bytes - used) // rb
            if fit == 0:
                chunks.append(Chunk(len(chunks), tuple(spans), used))
                spans, used = [], 0
                continue
            take = min(fit, n - done)
            spans.append(Span(g, done, done + take))
            used += take * rb
            done += take
    if spans:
        chunks.append(Chunk(len(chunks), tuple(spans), used))
    return chunks


def num_chunks(counts: Sequence[int], row_bytes: Sequence[int], chunk_bytes: int) -> int:
    return len(split_chunks(counts, row_bytes, chunk_bytes))


def span_offsets(rows: Sequence[int], row_bytes: Sequence[int]) -> tuple[list[int], int]:
    """Byte offset of each group's section in a slot, and the total, for ``rows[g]`` rows."""
    offsets: list[int] = []
    total = 0
    for n, rb in zip(rows, row_bytes, strict=True):
        offsets.append(total)
        total += n * rb
    return offsets, total
