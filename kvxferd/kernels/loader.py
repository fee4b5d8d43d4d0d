"""Which implementation runs, and the JIT build of the CUDA extension.

The CUDA extension (``cuda/staging.cu`` and ``cuda/copy_ranges.cu``, whose torch ops it
registers, and ``cuda/bindings.cpp``, its Python module: :func:`cuda_module`) is built with
:func:`torch.utils.cpp_extension.load` for the compute capabilities of the visible GPUs
(``sm_90`` on Hopper) into a cache directory under the system temp dir, only when torch sees a
GPU, torch is a CUDA build, ``nvcc`` is found and the sources are present. Otherwise the
plain-torch twin runs. The CPU install never needs ``nvcc``. :func:`active_backend` says which
is active and why; the first call on a GPU machine builds (tens of seconds, cached afterwards),
so the daemon calls it at start-up (``kvxferd.service.app``), never on a pull's path.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from kvxferd.logs import kv

log = logging.getLogger(__name__)

SOURCES = ("staging.cu", "copy_ranges.cu", "bindings.cpp")
_OPS = (
    "gather_blocks",
    "scatter_blocks",
    "vector_width",
    "copy_ranges",
    "copy_vector_width",
    "copy_group",
)


class BackendName(StrEnum):
    CUDA = "cuda"  # the kernels of cuda/staging.cu
    TORCH = "torch"  # the plain-torch twin (kvxferd.kernels.twin)


@dataclass(frozen=True)
class Backend:
    """The active implementation for CUDA tensors, and why (CPU tensors always use the twin)."""

    name: BackendName
    reason: str
    archs: tuple[str, ...] = ()
    build_s: float = 0.0

    def describe(self) -> str:
        arch = f" archs={','.join(self.archs)}" if self.archs else ""
        return f"kernels={self.name.value}{arch} ({self.reason})"


_lock = threading.Lock()
_state: dict[str, Backend] = {}  # "active" once decided
_module: list[Any] = []  # the built extension's Python module (cuda/bindings.cpp), once built


def cuda_source_dir() -> Path:
    """The kernels' sources: ``kvxferd/kernels/cuda``, a link to ``cuda/`` at the repository
    root that ships in the wheel as package data, so an installed kvxferd (the Docker image
    too) builds the same kernels."""
    return Path(__file__).resolve().parent / "cuda"


def _nvcc() -> str | None:
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _why_not() -> str | None:
    if torch.version.cuda is None:
        return "torch is not a CUDA build"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    if _nvcc() is None:
        return "nvcc not found (set CUDA_HOME)"
    missing = [s for s in SOURCES if not (cuda_source_dir() / s).exists()]
    if missing:
        return f"CUDA sources missing from {cuda_source_dir()}: {missing}"
    return None


def _archs() -> tuple[str, ...]:
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return tuple(f"{major}{minor}" for major, minor in sorted(caps))


def build_dir(archs: tuple[str, ...]) -> Path:
    """Where the extension is built: one directory per torch, CUDA, architectures and sources
    (a digest of their contents), so two kvxferd versions on one machine (an upgrade rolling
    through a host's daemons) never rebuild over each other's library."""
    digest = hashlib.sha256()
    for path in sorted(cuda_source_dir().iterdir()):  # the sources and the headers they include
        if path.suffix in (".cu", ".cuh", ".cpp"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    tag = (
        f"torch{torch.__version__}-cu{torch.version.cuda}-sm{'_'.join(archs)}"
        f"-src{digest.hexdigest()[:12]}"
    )
    safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in tag)
    return Path(tempfile.gettempdir()) / "kvxferd-cuda" / safe


def _build(verbose: bool) -> Backend:
    from torch.utils import cpp_extension

    archs = _archs()
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    where = build_dir(archs)
    where.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = cpp_extension.load(
            name="kvxferd_staging",
            sources=[str(cuda_source_dir() / s) for s in SOURCES],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-lineinfo", *gencode],
            build_directory=str(where),
            is_python_module=True,
            verbose=verbose,
        )
    for w in caught:
        log.info("CUDA kernel build warning", extra=kv(message=str(w.message)))
    ops = torch.ops.kvxferd
    for name in _OPS:
        getattr(ops, name)  # raises if the library did not register the op
    module.copy_group_raw  # noqa: B018 (raises if the binding is missing)
    _module.append(module)
    dt = time.monotonic() - t0
    log.info(
        "CUDA kernels built",
        extra=kv(archs=",".join(archs), dir=str(where), seconds=round(dt, 1)),
    )
    return Backend(BackendName.CUDA, f"built for sm_{'/sm_'.join(archs)} in {where}", archs, dt)


def active_backend(*, verbose: bool = False) -> Backend:
    """The implementation used for CUDA tensors; builds the extension on first call if it can.

    A failed build is logged and leaves the twin active (the reason says what failed).
    """
    with _lock:
        found = _state.get("active")
        if found is None:
            why = _why_not()
            if why is not None:
                found = Backend(BackendName.TORCH, why)
            else:
                try:
                    found = _build(verbose)
                except Exception as exc:
                    log.warning("CUDA kernel build failed", extra=kv(error=repr(exc)))
                    found = Backend(BackendName.TORCH, f"CUDA build failed: {exc}")
            _state["active"] = found
            log.info("kernel backend chosen", extra=kv(backend=found.describe()))
        return found


def cuda_ops() -> Any:
    """``torch.ops.kvxferd`` once the extension is loaded; raises when the twin is active."""
    b = active_backend()
    if b.name is not BackendName.CUDA:
        from kvxferd.errors import ConfigError

        raise ConfigError(f"the CUDA staging kernels are not available: {b.reason}")
    return torch.ops.kvxferd


def cuda_module() -> Any:
    """The extension's Python module (``cuda/bindings.cpp``: hot-path launches as plain
    functions) once built; raises when the twin is active."""
    cuda_ops()
    return _module[0]
