"""Typed wrappers over the CUDA staging ops (``torch.ops.kvxferd.*`` from ``cuda/staging.cu``).

Same signatures and semantics as :mod:`kvxferd.kernels.twin`. Inputs are checked here (typed
errors) and again by the C++ launcher; work is queued on the current CUDA stream of the
staging buffer's device and returns without synchronising.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvxferd.errors import InvalidRequest
from kvxferd.kernels.geometry import BlockIds, KVPermute, check_call
from kvxferd.kernels.loader import cuda_module, cuda_ops
from kvxferd.kernels.ranges import (
    CheckedCopy,
    CopyKernel,
    GroupCopy,
    RangeCopy,
    RegionsLike,
    address_table,
    check_copy,
    check_ranges,
)

_OVERLOADS: dict[str, Any] = {}


def _op(name: str) -> Any:
    """The op's default overload, looked up once: called directly, it skips the overload
    resolution that ``torch.ops.kvxferd.<name>(...)`` does on every call (a flat copy's
    launch is one such call)."""
    op = _OVERLOADS.get(name)
    if op is None:
        op = _OVERLOADS[name] = getattr(cuda_ops(), name).default
    return op


def _raise_if(err: str) -> None:
    """The launcher returns "" or a message (it never throws; see cuda/staging.cu)."""
    if err:
        raise InvalidRequest(err, fix="check the regions, block IDs and staging buffer")


def _require_cuda(device: torch.device, op: str) -> None:
    if device.type != "cuda":
        raise InvalidRequest(f"{op}: the CUDA kernels need CUDA tensors", field="staging")


def gather_blocks(
    regions: Sequence[torch.Tensor],
    block_ids: BlockIds,
    out: torch.Tensor,
    *,
    permute: KVPermute | None = None,
) -> torch.Tensor:
    """Copy block ``ids[i]`` of every region into staging row ``i`` of ``out``; returns ``out``."""
    c = check_call(regions, block_ids, out, permute, op="gather_blocks", unique=False)
    _require_cuda(out.device, "gather_blocks")
    args = permute.kernel_args() if permute is not None else []
    _raise_if(cuda_ops().gather_blocks(list(regions), c.ids, out, args))
    return out


def scatter_blocks(
    regions: Sequence[torch.Tensor],
    block_ids: BlockIds,
    staging: torch.Tensor,
    *,
    permute: KVPermute | None = None,
) -> None:
    """Copy staging row ``i`` into block ``ids[i]`` of every region (IDs must not repeat)."""
    c = check_call(regions, block_ids, staging, permute, op="scatter_blocks", unique=True)
    _require_cuda(staging.device, "scatter_blocks")
    args = permute.kernel_args() if permute is not None else []
    _raise_if(cuda_ops().scatter_blocks(list(regions), c.ids, staging, args))


def vector_width(
    regions: Sequence[torch.Tensor],
    block_ids: BlockIds,
    staging: torch.Tensor,
    *,
    permute: KVPermute | None = None,
) -> int:
    """Bytes per load/store the kernel would use for this call (16 when all is aligned)."""
    _require_cuda(staging.device, "vector_width")
    c = check_call(regions, block_ids, staging, permute, op="vector_width", unique=False)
    args = permute.kernel_args() if permute is not None else []
    return int(cuda_ops().vector_width(list(regions), c.ids, staging, args))


def copy_ranges(
    dst: RegionsLike,
    src: RegionsLike,
    ranges: RangeCopy,
    *,
    max_ctas: int = 0,
    kernel: CopyKernel = CopyKernel.STRIDE,
) -> None:
    """Copy every piece of ``ranges`` from ``src`` to ``dst`` in one launch on the current
    stream of the destination's device (``max_ctas``: grid cap, 0 for as many CTAs as fit on
    the device at once; ``kernel``: which copy kernel, see ``cuda/copy_ranges.cu``)."""
    run_copy(check_copy(dst, src, ranges, tables=True), max_ctas=max_ctas, kernel=kernel)


def copy_groups(
    dst: RegionsLike, src: RegionsLike, groups: Sequence[GroupCopy], *, max_ctas: int = 0
) -> None:
    """Copy every group's pieces in every region of the group, one launch per group on the
    current stream of the destination's device (``copy_group`` in ``cuda/copy_ranges.cu``);
    every group is checked (:func:`check_groups`) before the first launch."""
    run_copy(check_copy(dst, src, groups, tables=True), max_ctas=max_ctas)


def run_copy(
    c: CheckedCopy, *, max_ctas: int = 0, kernel: CopyKernel = CopyKernel.STRIDE, stream: int = 0
) -> None:
    """Launch a copy :func:`check_copy` checked and built the tables of: one launch per table
    on ``stream`` (a ``cudaStream_t`` as an integer, ``torch.cuda.Stream.cuda_stream``; 0 for
    the current stream of the destination's device); no host work but the launches."""
    _require_cuda(c.dst.device, "copy_ranges")  # the device the regions were checked on
    if not c.cuda:
        raise InvalidRequest("run_copy: the copy was prepared for the twin (no launch tables)")
    like = c.dst.tensors[0]
    if c.ranges is not None:
        copy_ranges = _op("copy_ranges")
        for table in c.tables:
            _raise_if(copy_ranges(table, like, int(max_ctas), int(kernel), stream))
        return
    # The binding, not the op: the dispatcher's path costs 15-50 us per launch when the CPU
    # caches are cold for it, as a daemon's are (cuda/bindings.cpp). The tables are contiguous
    # int64 CPU tensors (CheckedCopy checks them when it is made) that ``c`` keeps alive; the
    # call copies their values before it returns.
    copy_group = cuda_module().copy_group_raw
    device = int(c.dst.device.index or 0)  # the device the regions were checked on
    for g, table in zip(c.groups, c.tables, strict=True):
        n, k = int(g.length.shape[0]), int(g.regions.shape[0])
        _raise_if(copy_group(table.data_ptr(), table.numel(), n, k, device, int(max_ctas), stream))


def copy_vector_width(dst: RegionsLike, src: RegionsLike, ranges: RangeCopy) -> int:
    """Bytes per load/store :func:`copy_ranges` would use (16 when all is aligned)."""
    d, s = check_ranges(dst, src, ranges)
    return int(cuda_ops().copy_vector_width(address_table(d, s, ranges)))
