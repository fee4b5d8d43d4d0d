"""Shared host memory for IMPORTED attaches: the engine allocates, the daemon imports.

Segments are remembered by base address so that a tensor passed to ``attach`` can be traced
back to its segment, and unlinked on detach or at exit. Each segment's mapping holds one open
descriptor while it lives (kvxferd/attach/shm.py), so a spec that cannot be allocated in full
lets go of (and unlinks) the segments it made before it failed.
"""

from __future__ import annotations

import atexit
import os
import threading
import traceback
import uuid
from collections.abc import Sequence

import torch

from kvxferd.attach import ShmSegment, region_tensor
from kvxferd.errors import InvalidRequest
from kvxferd.layout.spec import KVCacheSpec, MemoryType

_SHARED: dict[int, tuple[int, ShmSegment]] = {}  # base address -> (size, segment)
_SHARED_LOCK = threading.Lock()


def shared_tensors(spec: KVCacheSpec, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Allocate ``spec``'s regions where the daemon can import them (IMPORTED mode).

    ``cpu``: one POSIX shared-memory segment per region (unlinked when detached, or at exit);
    ``cuda:N``: ordinary torch allocations, laid out as the spec says (any CUDA tensors of that
    layout will do: the daemon maps them over CUDA IPC and serves them with same-host KERNEL
    pulls only; docs/attachment.md).
    """
    if device.startswith("cuda"):
        from kvxferd.layout.alloc import allocate_pool

        return allocate_pool(spec.with_memory(MemoryType.VRAM), device)
    out: dict[str, torch.Tensor] = {}
    made: list[ShmSegment] = []
    try:
        _create_all(spec, made, out)
    except BaseException as exc:
        # The tensors made so far live on in the failed frames' locals, which the traceback
        # keeps while anything holds the exception: clear them, then drop and unlink each.
        traceback.clear_frames(exc.__traceback__)
        out.clear()
        forget_shared(made)
        for seg in made:
            seg.release()
        made.clear()
        raise
    return out


def _create_all(spec: KVCacheSpec, made: list[ShmSegment], out: dict[str, torch.Tensor]) -> None:
    tag = f"kvxferd-engine-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    for i, r in enumerate(spec.regions):
        seg = ShmSegment.create(f"{tag}-{i}", r.nbytes, who="engine")
        made.append(seg)
        raw = seg.tensor(0, r.nbytes)
        with _SHARED_LOCK:
            _SHARED[int(raw.data_ptr())] = (seg.size, seg)
        out[r.name] = region_tensor(r, raw)


def unlink_shared(segments: Sequence[ShmSegment]) -> None:
    for seg in segments:
        seg.unlink()


@atexit.register
def _unlink_all_shared() -> None:
    with _SHARED_LOCK:
        segs = [s for _, s in _SHARED.values()]
    unlink_shared(segs)


def find_shared(t: torch.Tensor, what: str) -> tuple[ShmSegment, int]:
    ptr = int(t.data_ptr())
    with _SHARED_LOCK:
        for base, (size, seg) in _SHARED.items():
            if base <= ptr < base + size:
                return seg, ptr - base
    raise InvalidRequest(
        f"{what} is not in shared memory, so the daemon cannot import it",
        field="tensors",
        fix="allocate IMPORTED DRAM with kvxferd.engine.shared_tensors(spec), or attach OWNED",
    )


# -- the attachment ------------------------------------------------------------------------------


def forget_shared(segments: Sequence[ShmSegment]) -> None:
    """Unlink ``segments`` (their attachment ended) and stop tracing tensors to them."""
    unlink_shared(segments)
    with _SHARED_LOCK:
        for base, (_, seg) in list(_SHARED.items()):
            if seg in segments:
                del _SHARED[base]


__all__ = ["find_shared", "forget_shared", "shared_tensors", "unlink_shared"]
