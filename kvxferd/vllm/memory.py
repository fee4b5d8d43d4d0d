"""vLLM's KV cache backing buffer in POSIX shared memory the daemon can import (no vLLM import).

vLLM 0.32 allocates the whole KV cache as one ``torch.zeros(size, dtype=torch.int8)`` inside
the context its connector returns from ``get_mem_pool_context()``, then views every layer in
it. :class:`SharedKvAllocation` is that context for host memory: a torch function mode that
serves exactly that allocation from a fresh shared-memory segment (zero-filled by
``ftruncate``), so the bytes the model computes into are the bytes the daemon registers with
NIXL (an IMPORTED attach, docs/attachment.md). Everything else passes through untouched.

The segment's name is removed as soon as the daemon has mapped it (:meth:`unlink`), so
nothing is left in ``/dev/shm`` even if the engine is killed; the memory itself lives until
both processes unmap it.
"""

from __future__ import annotations

import atexit
import os
import uuid
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kvxferd.attach import ShmSegment
from kvxferd.errors import SpecError

DOC = "docs/vllm.md"


class SharedKvAllocation(TorchFunctionMode):
    """Serve the first CPU ``torch.zeros(n, dtype=torch.int8)`` from shared memory."""

    def __init__(self, prefix: str = "kvxferd-vllm") -> None:
        super().__init__()
        self.prefix = prefix
        self.segment: ShmSegment | None = None
        self.buffer: torch.Tensor | None = None
        atexit.register(self.unlink)

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and self.segment is None and self._is_kv_buffer(args, kwargs):
            return self._allocate(int(args[0]))
        return func(*args, **kwargs)

    @staticmethod
    def _is_kv_buffer(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        device = torch.device(kwargs.get("device") or "cpu")
        return (
            len(args) == 1
            and isinstance(args[0], int)
            and kwargs.get("dtype") is torch.int8
            and device.type == "cpu"
        )

    def _allocate(self, size: int) -> torch.Tensor:
        name = f"{self.prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.segment = ShmSegment.create(name, size)  # ftruncate: zero-filled
        self.buffer = self.segment.tensor(0, size).view(torch.int8)
        return self.buffer

    def require(self) -> tuple[ShmSegment, torch.Tensor]:
        """The segment and buffer; SpecError if vLLM allocated its KV cache elsewhere."""
        if self.segment is None or self.buffer is None:
            raise SpecError(
                "vLLM did not allocate its KV cache inside the connector's memory context, so"
                " the daemon cannot serve it",
                fix="use a vLLM version whose CPU worker honours get_mem_pool_context()"
                f" (0.32 does; see {DOC})",
            )
        return self.segment, self.buffer

    def unlink(self) -> None:
        """Remove the segment's name (mappings stay valid)."""
        if self.segment is not None:
            self.segment.unlink()
