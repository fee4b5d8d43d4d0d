"""The connector's GPU path: vLLM's CUDA KV cache attached to the daemon as IMPORTED VRAM.

No vLLM import: :func:`attach_cuda` takes vLLM's ``kv_cache_config`` and the tensors its
worker registered, so tests run it on real CUDA tensors against real daemons without vLLM.

vLLM allocates its KV cache on the GPU itself (PyTorch's caching allocator); the connector
describes those tensors as a kvxferd spec (:mod:`kvxferd.vllm.tensors`), exports each region
over CUDA IPC (the handle of the allocation it sits in and its offset there,
:func:`kvxferd.attach.cuda_ipc.export_tensor`) and attaches them IMPORTED. The daemon maps
them, registers nothing with NIXL and serves them to readers on the same host with KERNEL
pulls (docs/attachment.md); readers elsewhere are refused at StartPull with the reason.

Refused at start, with the fix (docs/vllm.md): memory that cannot be exported
(``expandable_segments``, vLLM's sleep mode allocator), a layout kvxferd cannot describe, and a
daemon that cannot map the memory (not on this GPU, DRAM only, ``transfer.cuda_ipc`` off).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvxferd.errors import KvxferdError, SpecError
from kvxferd.ipc.host import device_uuid
from kvxferd.v1 import engine_pb2
from kvxferd.vllm.daemon import EngineLink, Import, Release
from kvxferd.vllm.kinds import DOC, see_doc
from kvxferd.vllm.spec import kernel_block_sizes, region_strides
from kvxferd.vllm.tensors import DescribedKv, describe

# vLLM's logger tree: inside vLLM these lines go through its handler, format and level.
log = logging.getLogger("vllm.kvxferd")

_ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@dataclass(frozen=True)
class CudaAttach:
    """What :func:`attach_cuda` attached."""

    pool: engine_pb2.PoolInfo
    described: DescribedKv


def check_exportable(env: Mapping[str, str] | None = None) -> None:
    """Refuse PyTorch's expandable segments: ``cuIpcGetMemHandle`` cannot export them."""
    env = os.environ if env is None else env
    for key in _ALLOC_CONF:
        conf = env.get(key, "").replace(" ", "").lower()
        if "expandable_segments:true" in conf:
            raise SpecError(
                f"{key}={env[key]} makes PyTorch allocate the KV cache from expandable"
                " segments, which CUDA IPC cannot export to the kvxferd daemon",
                fix=f"unset expandable_segments in {key} for this engine (see {DOC})",
            )


def cuda_imports(described: DescribedKv) -> list[Import]:
    """Export every region over CUDA IPC: its allocation's handle and its offset there."""
    from kvxferd.attach.cuda_ipc import export_tensor

    out = []
    for r in described.spec.regions:
        t = described.tensors[r.name]
        try:
            ex = export_tensor(t, r.nbytes)
        except SpecError as err:
            raise SpecError(
                f"region {r.name!r} cannot be exported over CUDA IPC: {err.message}",
                fix=f"{err.fix}; vLLM's --enable-sleep-mode allocator cannot be exported"
                f" either: run without it (see {DOC})",
            ) from None
        out.append(
            Import(
                r.name,
                "",
                ex.offset,
                r.nbytes,
                r.shape,
                region_strides(r),
                cuda_ipc_handle=ex.handle,
                device_id=ex.device,
                device_uuid=device_uuid(ex.device) or "",
            )
        )
    return out


def attach_cuda(
    link: EngineLink,
    kv_cache_config: Any,
    kv_caches: Mapping[str, torch.Tensor],
    *,
    model: str,
    layout: Any = None,
    backend: str = "",
    backend_cls: Any = None,
    cache_dtype: str = "auto",
    tp_rank: int = 0,
    tp_size: int = 1,
    prefix_caching: bool,
    wait_s: float,
    on_release: Callable[[Release], None],
) -> CudaAttach:
    """Describe vLLM's CUDA KV tensors, export them and attach them IMPORTED VRAM to the
    daemon on ``link`` (waiting up to ``wait_s`` for its socket). Raises RuntimeError saying
    what was wrong and the fix."""
    try:
        check_exportable()
        described = describe(
            kv_cache_config,
            kv_caches,
            model=model,
            layout=layout,
            kernel_block_sizes=kernel_block_sizes(kv_cache_config, kv_caches),
            backend=backend,
            backend_cls=backend_cls,
            tp_rank=tp_rank,
            tp_size=tp_size,
            cache_dtype=cache_dtype,
        )
        if described.device.type != "cuda":
            raise SpecError(
                f"vLLM's KV cache is on {described.device}, not on a GPU",
                fix=f"the GPU path attaches CUDA tensors (see {DOC})",
            )
        imports = cuda_imports(described)
    except KvxferdError as err:
        raise RuntimeError(
            see_doc(f"KvxferdConnector: vLLM's GPU KV cache cannot be attached: {err}")
        ) from None
    try:
        link.wait_ready(wait_s)
        pool = link.attach(
            described.spec,
            imports,
            tp_rank=described.tp_rank,
            tp_size=described.tp_size,
            prefix_caching=prefix_caching,
            on_release=on_release,
        )
    except KvxferdError as err:
        raise RuntimeError(
            see_doc(
                f"KvxferdConnector: attaching the GPU KV cache (IMPORTED VRAM on"
                f" {described.device}) to the daemon at unix:{link.socket_path} failed: {err}."
                " The daemon must run on this engine's host and GPU (pool.device ="
                f" {described.device} where the daemon numbers the GPUs as this engine does;"
                " the GPU is matched by UUID) with pool.mode = attached, transfer.cuda_ipc ="
                " true and transfer.mode = pull"
            )
        ) from None
    log.info(
        "kvxferd: attached %d bytes of GPU KV cache (%s; IMPORTED VRAM on %s, served to"
        " same-host readers with KERNEL pulls) to the daemon at %s as attachment %s",
        described.spec.nbytes,
        described.page_format,
        described.device,
        pool.peer_address,
        pool.attachment_id,
    )
    return CudaAttach(pool, described)


__all__ = ["CudaAttach", "attach_cuda", "check_exportable", "cuda_imports"]
