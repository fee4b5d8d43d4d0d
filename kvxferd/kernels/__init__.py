"""CUDA ops of kvxferd: staging kernels that gather a request's blocks and scatter them back.

Owns every CUDA op of the daemon and is the only package that touches ``cuda/`` (the kernels,
their launchers and torch op registration). Layers, FlashInfer-style: kernels in
``cuda/staging.cuh``; a launcher that checks every tensor and registers ``torch.ops.kvxferd.*``
(``cuda/staging.cu``); typed wrappers (:mod:`.cuda_ops`); a plain-torch twin with the same
signatures (:mod:`.twin`), which is the CPU fallback and the test oracle; the JIT loader and the
choice between them (:mod:`.loader`).

:func:`copy_ranges` copies a KERNEL pull's byte ranges from regions mapped over CUDA IPC into
the pool's regions in one launch (:mod:`.ranges`; ``cuda/copy_ranges.cu``).

:func:`gather_blocks` copies block ``ids[i]`` of every region into row ``i`` of a contiguous
staging buffer; :func:`scatter_blocks` does the reverse; either can swap tokens and heads
(NHD <-> HND) inside every K/V half in the same pass (:class:`KVPermute`). Geometry and the
staging layout are described in :mod:`.geometry`. Block IDs are checked on the host before
anything runs. For a pipelined transfer, call them on row ranges (chunks) of the staging
buffer, on the stream that should carry the work.

Must not import: ``nixl`` / :mod:`kvxferd.nixl`, ``grpc``, :mod:`kvxferd.service`,
:mod:`kvxferd.transfer` (the transfer engine calls this package, never the reverse).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvxferd.kernels import twin
from kvxferd.kernels.geometry import (
    BlockIds,
    HeadOrder,
    KVPermute,
    block_view,
    row_bytes,
)
from kvxferd.kernels.loader import Backend, BackendName, active_backend
from kvxferd.kernels.ranges import (
    CheckedCopy,
    CopyKernel,
    GroupCopy,
    RangeCopy,
    Regions,
    RegionsLike,
    check_copy,
)

__all__ = [
    "Backend",
    "BackendName",
    "BlockIds",
    "CheckedCopy",
    "CopyKernel",
    "GroupCopy",
    "HeadOrder",
    "KVPermute",
    "RangeCopy",
    "Regions",
    "active_backend",
    "block_view",
    "copy_groups",
    "copy_ranges",
    "gather_blocks",
    "prepare_copy",
    "row_bytes",
    "run_copy",
    "scatter_blocks",
]


def _use_cuda(device: torch.device) -> bool:
    return device.type == "cuda" and active_backend().name is BackendName.CUDA


def gather_blocks(
    regions: Sequence[torch.Tensor],
    block_ids: BlockIds,
    out: torch.Tensor,
    *,
    permute: KVPermute | None = None,
) -> torch.Tensor:
    """Copy block ``ids[i]`` of every region into staging row ``i`` of ``out``; returns ``out``.

    ``regions``: ``(num_blocks, block_len)`` uint8 block views (:func:`block_view`) on the
    device of ``out``; ``block_ids``: host integers, each below every region's ``num_blocks``;
    ``out``: contiguous uint8, exactly ``len(block_ids) * row_bytes(regions)`` bytes. Runs the
    CUDA kernels for CUDA tensors when :func:`active_backend` says so, else the twin.
    """
    if _use_cuda(out.device):
        from kvxferd.kernels import cuda_ops

        return cuda_ops.gather_blocks(regions, block_ids, out, permute=permute)
    return twin.gather_blocks(regions, block_ids, out, permute=permute)


def scatter_blocks(
    regions: Sequence[torch.Tensor],
    block_ids: BlockIds,
    staging: torch.Tensor,
    *,
    permute: KVPermute | None = None,
) -> None:
    """Copy staging row ``i`` into block ``ids[i]`` of every region (the reverse of
    :func:`gather_blocks`; IDs must not repeat)."""
    if _use_cuda(staging.device):
        from kvxferd.kernels import cuda_ops

        cuda_ops.scatter_blocks(regions, block_ids, staging, permute=permute)
        return
    twin.scatter_blocks(regions, block_ids, staging, permute=permute)


def prepare_copy(
    dst: RegionsLike, src: RegionsLike, pieces: RangeCopy | Sequence[GroupCopy]
) -> CheckedCopy:
    """Check ``pieces`` (flat, or :class:`GroupCopy` groups) against both sides and build what
    the launch needs, so that :func:`run_copy` does nothing but launch: a KERNEL pull prepares
    while its lease confirmation is in flight and launches once it succeeded."""
    d = Regions.of("dst", dst)
    # The device the regions were checked on (read once, with them), not each tensor's.
    return check_copy(d, src, pieces, tables=bool(len(d)) and _use_cuda(d.device))


def run_copy(
    c: CheckedCopy, *, max_ctas: int = 0, kernel: CopyKernel = CopyKernel.STRIDE, stream: int = 0
) -> str:
    """Run a copy :func:`prepare_copy` returned: the CUDA kernels (one launch per table, on
    ``stream``, a ``cudaStream_t`` as an integer, or with 0 the current stream) when it was
    prepared for them, else the twin. Returns which ran (``"cuda"`` or ``"torch"``)."""
    if c.cuda:
        from kvxferd.kernels import cuda_ops

        cuda_ops.run_copy(c, max_ctas=max_ctas, kernel=kernel, stream=stream)
        return BackendName.CUDA.value
    twin.run_copy(c)
    return BackendName.TORCH.value


def copy_ranges(
    dst: RegionsLike,
    src: RegionsLike,
    ranges: RangeCopy,
    *,
    max_ctas: int = 0,
    kernel: CopyKernel = CopyKernel.STRIDE,
) -> str:
    """Copy ``ranges`` from ``src`` regions into ``dst`` regions (1-D uint8, one device, or
    :class:`Regions` checked once); the CUDA kernel (one launch, current stream) on CUDA tensors
    when :func:`active_backend` says so, else the twin. Returns which ran (``"cuda"`` or
    ``"torch"``)."""
    return run_copy(prepare_copy(dst, src, ranges), max_ctas=max_ctas, kernel=kernel)


def copy_groups(
    dst: RegionsLike, src: RegionsLike, groups: Sequence[GroupCopy], *, max_ctas: int = 0
) -> str:
    """:func:`copy_ranges` for pieces that repeat over regions (:class:`GroupCopy`): one launch
    per group, its table the runs once and the regions' bases (``cuda/copy_ranges.cu``,
    copy_group), so the host never builds the region-by-run product. Returns which ran."""
    return run_copy(prepare_copy(dst, src, groups), max_ctas=max_ctas)
