"""What a run ran on: CPU, memory, GPUs, versions, transports (for benchmark reports)."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any

from kvxferd import busypoll

NIXL_DISTRIBUTIONS = ("nixl", "nixl-cu13", "nixl-cu12")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def gpus() -> list[str]:
    """Names of the CUDA devices torch sees (empty without CUDA)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken driver must not break the report
        return []


def machine() -> dict[str, Any]:
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count() or 0,
        "memory_gib": round(_memory_gib(), 1),
        "gpus": gpus(),
        "platform": platform.platform(),
    }


def versions() -> dict[str, str]:
    import torch

    out = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda or ""),
        "kvxferd": _version("kvxferd"),
        "grpcio": _version("grpcio"),
    }
    for dist in NIXL_DISTRIBUTIONS:
        v = _version(dist)
        if v:
            out[dist] = v
    return out


def transports() -> dict[str, str]:
    """The UCX environment (UCX_TLS and friends); empty means UCX picks the transports."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}


def busy_polling() -> dict[str, Any]:
    """What ``server.busy_poll`` gives the daemons this process starts (they inherit its
    environment and CPU affinity): on or off and why (kvxferd/busypoll.py)."""
    from kvxferd.config import load_config

    server = load_config(None).server
    on, why = busypoll.resolve(server.busy_poll, busypoll.usable_cpus())
    return {"on": on, "why": why, "window_ms": server.busy_poll_window_ms}


def describe(info: dict[str, Any], vers: dict[str, str], env: dict[str, str]) -> list[str]:
    """Report lines for :func:`machine`, :func:`versions` and :func:`transports`."""
    gpu = ", ".join(info["gpus"]) or "none"
    ver = ", ".join(f"{k} {v}" for k, v in vers.items() if v)
    ucx = " ".join(f"{k}={v}" for k, v in env.items()) or "UCX_TLS unset (UCX picks transports)"
    return [
        f"machine:    {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB; GPUs: {gpu}",
        f"versions:   {ver}",
        f"transports: NIXL UCX backend; {ucx}",
    ]
