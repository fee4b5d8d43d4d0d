"""The connector's CPU path: vLLM's KV cache in shared memory attached as IMPORTED host memory.

No vLLM import: :func:`attach_shared` takes vLLM's ``kv_cache_config``, the shared-memory
allocation vLLM made its KV cache in (:class:`kvxferd.vllm.memory.SharedKvAllocation`) and
the per-layer views its worker registered, so tests run it against real daemons without vLLM.
It translates the config into a kvxferd spec (:func:`kvxferd.vllm.spec.translate`), checks
the translation against the real views, and attaches every region IMPORTED at this worker's
TP position; the segment's name is removed once the daemon has mapped it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvxferd.errors import KvxferdError
from kvxferd.v1 import engine_pb2
from kvxferd.vllm.daemon import EngineLink, Import, Release
from kvxferd.vllm.kinds import see_doc
from kvxferd.vllm.memory import SharedKvAllocation
from kvxferd.vllm.spec import (
    VllmKvSpec,
    check_views,
    kernel_block_sizes,
    region_strides,
    translate,
)

# vLLM's logger tree: inside vLLM these lines go through its handler, format and level.
log = logging.getLogger("vllm.kvxferd")


@dataclass(frozen=True)
class HostAttach:
    """What :func:`attach_shared` attached."""

    pool: engine_pb2.PoolInfo
    translated: VllmKvSpec


def attach_shared(
    link: EngineLink,
    alloc: SharedKvAllocation,
    kv_cache_config: Any,
    kv_caches: Mapping[str, Any],
    *,
    model: str,
    layout: Any,
    backend: str = "",
    cache_dtype: str = "auto",
    tp_rank: int = 0,
    tp_size: int = 1,
    prefix_caching: bool,
    wait_s: float,
    on_release: Callable[[Release], None],
) -> HostAttach:
    """Attach vLLM's host KV cache (allocated in ``alloc``) to the daemon on ``link`` at TP
    position ``(tp_rank, tp_size)``, waiting up to ``wait_s`` for its socket. Raises
    RuntimeError saying what was wrong and the fix."""
    try:
        seg, buf = alloc.require()
        translated = translate(
            kv_cache_config,
            model=model,
            layout=layout,
            kernel_block_sizes=kernel_block_sizes(kv_cache_config, kv_caches),
            backend=backend,
            tp_rank=tp_rank,
            tp_size=tp_size,
            cache_dtype=cache_dtype,
        )
        check_views(
            translated,
            int(buf.data_ptr()),
            {n: int(t.data_ptr()) for n, t in kv_caches.items()},
        )
    except KvxferdError as err:
        alloc.unlink()
        raise RuntimeError(
            see_doc(f"KvxferdConnector: vLLM's KV cache cannot be described to the daemon: {err}")
        ) from None
    imports = [
        Import(
            r.name,
            seg.name,
            translated.placement(r.name).offset,
            r.nbytes,
            r.shape,
            region_strides(r),
        )
        for r in translated.spec.regions
    ]
    try:
        link.wait_ready(wait_s)
        pool = link.attach(
            translated.spec,
            imports,
            tp_rank=tp_rank,
            tp_size=tp_size,
            prefix_caching=prefix_caching,
            on_release=on_release,
        )
    except KvxferdError as err:
        raise RuntimeError(
            see_doc(
                f"KvxferdConnector: attaching the KV cache of TP rank {tp_rank}/{tp_size} to"
                f" the daemon at unix:{link.socket_path} failed: {err}"
            )
        ) from None
    finally:
        alloc.unlink()
    log.info(
        "kvxferd: TP rank %d/%d attached %d bytes of KV cache (%s) to the daemon at %s as"
        " attachment %s",
        tp_rank,
        tp_size,
        translated.spec.nbytes,
        translated.page_format,
        pool.peer_address,
        pool.attachment_id,
    )
    return HostAttach(pool, translated)


__all__ = ["HostAttach", "attach_shared"]
