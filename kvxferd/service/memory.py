"""The daemon's memory: the KV pool (owned mode), the NIXL agent, its registrations, the
staging ring, and the transfer engine over them.

Built in that order, each undone in reverse through the caller's exit stack when a later
step fails. In attached mode there is no pool yet: the attacher registers the engine's
memory when it attaches.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from kvxferd.config import Config
from kvxferd.errors import ConfigError
from kvxferd.ipc.host import prepare_ucx_env
from kvxferd.kernels import active_backend
from kvxferd.layout.presets import preset
from kvxferd.layout.spec import KVCacheSpec, MemoryType
from kvxferd.layout.tomlspec import load_spec
from kvxferd.metrics import Metrics
from kvxferd.nixl import AgentOptions, MemType, NixlAgent
from kvxferd.pool import KVPool, gpu_fix
from kvxferd.staging.ring import StagingRing
from kvxferd.transfer import EngineOptions, TransferEngine

T = TypeVar("T")


def pool_spec(cfg: Config) -> KVCacheSpec:
    return load_spec(cfg.pool.spec_file) if cfg.pool.spec_file else preset(cfg.pool.preset)


def check_device(device: str) -> None:
    """Refuse a ``cuda[:N]`` device this process cannot see, naming pool.device."""
    if not device.startswith("cuda"):
        return
    import torch

    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index < count:
        return
    if count:
        reason, fix = f"only {count} GPU(s) are visible", f"use cuda:0 to cuda:{count - 1} or cpu"
    else:
        reason, fix = "no GPU is visible (or torch was built without CUDA)", "use cpu"
    raise ConfigError(
        f"device {device!r} cannot be used: {reason}",
        field="pool.device",
        fix=f"{fix} (check CUDA_VISIBLE_DEVICES)",
    )


def allocate(what: str, key: str, fix: str, make: Callable[[], T]) -> T:
    """``make()``, with an allocation failure turned into one line naming the key."""
    try:
        return make()
    # torch says "can't allocate" with RuntimeError (CUDA's torch.OutOfMemoryError is one), a
    # size past int64 with TypeError
    except (MemoryError, OverflowError, RuntimeError, TypeError, ValueError) as exc:
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise ConfigError(f"cannot allocate {what}: {lines[0][:200]}", field=key, fix=fix) from exc


def owned_pool(cfg: Config) -> KVPool:
    """The owned pool of ``cfg`` (its spec, then its memory); runs on a worker thread."""
    spec = pool_spec(cfg)
    key = "pool.spec_file" if cfg.pool.spec_file else "pool.preset"
    return allocate(
        f"the pool's {spec.nbytes} bytes on {cfg.pool.device}",
        key,
        f"give {key} fewer blocks (num_blocks) or fewer layers{gpu_fix(cfg.pool.device)}",
        lambda: KVPool.allocate(spec, cfg.pool.device),
    )


def staging_ring(cfg: Config) -> StagingRing:
    """The staging ring of ``cfg``; runs on a worker thread."""
    t = cfg.transfer
    return allocate(
        f"the staging ring's {t.staging_chunks} x {t.staging_chunk_bytes} bytes on"
        f" {cfg.pool.device}",
        "transfer.staging_chunks",
        "lower transfer.staging_chunks or transfer.staging_chunk_bytes, or set"
        f" transfer.staging_chunks = 0 to disable staging{gpu_fix(cfg.pool.device)}",
        lambda: StagingRing.allocate(t.staging_chunk_bytes, t.staging_chunks, cfg.pool.device),
    )


def agent_name(cfg: Config) -> str:
    return cfg.nixl.agent_name or f"kvxferd-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class Memory:
    """What :func:`open_memory` built: ``pool`` is None in attached mode until Attach."""

    pool: KVPool | None
    agent: NixlAgent
    mem: MemType
    ring: StagingRing | None
    engine: TransferEngine


async def open_memory(
    cfg: Config, metrics: Metrics, undo: contextlib.AsyncExitStack, fill_seed: int | None
) -> Memory:
    """Allocate, register and start; each step pushes its undo onto ``undo``."""
    check_device(cfg.pool.device)
    attached = cfg.pool.mode == "attached"
    pool = None if attached else await asyncio.to_thread(owned_pool, cfg)
    if pool is not None and fill_seed is not None:
        for g in range(len(pool.spec.groups)):
            await asyncio.to_thread(
                pool.fill_pattern, g, range(pool.spec.num_kernel_blocks(g)), fill_seed
            )
    cuda = None
    if cfg.pool.device.startswith("cuda"):
        cuda = int(cfg.pool.device.partition(":")[2] or 0)
        # Before NIXL starts (UCX reads its environment then): cuda_ipc GET zero-copy on a GPU
        # without NVLink (docs/nixl.md §7). Then the CUDA kernels, built once here and never on
        # a pull's path (a first build takes tens of seconds).
        prepare_ucx_env(cfg.pool.device)
        await asyncio.to_thread(active_backend)
    agent = NixlAgent(
        agent_name(cfg),
        cuda_device=cuda,
        options=AgentOptions(
            progress_delay_us=cfg.nixl.progress_delay_us,
            num_threads=cfg.nixl.num_threads,
            # The daemon times each pull itself (its stages), so it reads no NIXL telemetry: a
            # completion then goes from the end seen to its result without that call.
            capture_telemetry=False,
        ),
    )
    agent.start()
    undo.callback(agent.close)
    mem = MemType.DRAM
    if cfg.pool.device.startswith("cuda"):
        mem = MemType.VRAM
    rows = np.zeros((0, 3), dtype=np.int64)
    if pool is not None:
        mem = MemType.VRAM if pool.spec.regions[0].memory is MemoryType.VRAM else MemType.DRAM
        rows = pool.region_rows()
        await asyncio.to_thread(agent.register, rows, mem)
    ring, ring_row = None, np.zeros((0, 3), dtype=np.int64)
    if cfg.transfer.staging_chunks:
        # One staging ring, registered once for the daemon's life (attached pools come and
        # go); it is always the engine's last local region, after the pool's regions.
        ring = await asyncio.to_thread(staging_ring, cfg)
        ring_row = np.array([ring.info.row()], dtype=np.int64)
        await asyncio.to_thread(agent.register, ring_row, mem)
    engine_rows = np.vstack([rows, ring_row])
    engine = TransferEngine(
        agent,
        engine_rows,
        local_mem=mem,
        options=EngineOptions(
            max_inflight_bytes_per_peer=cfg.transfer.max_inflight_bytes_per_peer,
            default_timeout_s=cfg.transfer.default_deadline_ms / 1000,
        ),
    )
    engine.start()
    undo.callback(engine.close)
    return Memory(pool, agent, mem, ring, engine)


__all__ = ["Memory", "agent_name", "check_device", "open_memory", "owned_pool", "pool_spec"]
