"""The byte pattern an owner fills its memory with, and per-block digests to compare copies.

Every 8-byte word ``i`` of region ``r`` holds ``i * M + (seed << 48) + (r << 40) + 1`` (int64,
wrapping; ``M`` an odd golden-ratio constant), so a word moved to another offset, region or
seed is detected. :func:`pattern_words` computes it with NumPy, :func:`fill_pattern` writes it
into a tensor on its own device, and :func:`block_digests` hashes blocks of a region (BLAKE2b,
8 bytes) so two processes compare blocks without shipping them.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

Int64Array = npt.NDArray[np.int64]
MULTIPLIER = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio odd constant, as a signed int64
FILL_CHUNK_WORDS = 1 << 24
DIGEST_SIZE = 8


def _base(seed: int, region: int) -> int:
    return (seed << 48) + (region << 40) + 1


def pattern_words(seed: int, region: int, first_word: int, count: int) -> Int64Array:
    """The int64 words an owner writes at word indices ``first_word .. first_word+count``."""
    idx = np.arange(first_word, first_word + count, dtype=np.int64)
    with np.errstate(over="ignore"):
        out: Int64Array = idx * np.int64(MULTIPLIER) + np.int64(_base(seed, region))
    return out


def fill_pattern(buf: torch.Tensor, seed: int, region: int) -> None:
    """Write :func:`pattern_words` into ``buf`` (any dtype and device, a multiple of 8 bytes)."""
    import torch

    words = buf.view(torch.uint8).view(-1).view(torch.int64)
    for start in range(0, words.numel(), FILL_CHUNK_WORDS):
        n = min(FILL_CHUNK_WORDS, words.numel() - start)
        idx = torch.arange(start, start + n, dtype=torch.int64, device=buf.device)
        words[start : start + n] = idx * MULTIPLIER + _base(seed, region)


def block_digests(region: torch.Tensor, blocks: npt.ArrayLike, block_bytes: int) -> list[str]:
    """BLAKE2b-64 hex digests of blocks ``blocks`` of a byte tensor cut in ``block_bytes``."""
    import torch

    rows = region.view(torch.uint8).view(-1, block_bytes)
    ids = torch.from_numpy(np.asarray(blocks, dtype=np.int64)).to(rows.device)
    picked = rows[ids].cpu()
    return [
        hashlib.blake2b(r.numpy().tobytes(), digest_size=DIGEST_SIZE).hexdigest() for r in picked
    ]


def region_rows(tensors: list[torch.Tensor]) -> Int64Array:
    """The ``(address, bytes, device)`` rows NIXL registers, one per tensor."""
    return np.array(
        [[t.data_ptr(), t.numel() * t.element_size(), t.device.index or 0] for t in tensors],
        dtype=np.int64,
    )
