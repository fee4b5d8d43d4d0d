"""An engine's KV pool attached to one scenario daemon, with its bytes writable.

The TP scenario plays each rank's engine: it attaches an OWNED pool of the rank's spec and TP
position with the engine client (:class:`kvxferd.engine.EngineClient`: ``Attach``, the
session that keeps the attachment alive, the daemon's memory mapped here: shared memory for
DRAM, CUDA IPC for VRAM) and writes blocks straight into it, as a model computing its KV cache
would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvxferd.engine import EngineClient
from kvxferd.errors import KvxferdError
from kvxferd.layout.spec import KVCacheSpec
from kvxferd.pool import KVPool


class AttachedPool:
    """``spec`` attached OWNED to the daemon on ``engine_socket`` at TP ``(tp_rank, tp_size)``,
    in DRAM or, with ``vram``, in the daemon's GPU memory; :meth:`write` puts bytes into its
    blocks; :meth:`close` detaches."""

    def __init__(
        self,
        name: str,
        engine_socket: str,
        spec: KVCacheSpec,
        *,
        tp_rank: int,
        tp_size: int,
        token: str = "",
        vram: bool = False,
    ) -> None:
        self.name = name
        self._client = EngineClient(engine_socket, token=token)
        try:
            self._att = self._client.attach(
                spec, "owned", "cuda" if vram else "cpu", tp_rank=tp_rank, tp_size=tp_size
            )
        except BaseException:
            self._client.close()
            raise
        self.spec = self._att.spec
        self.attachment_id = self._att.attachment_id
        self.peer_address = self._att.peer_address
        self._pool: KVPool | None = KVPool(self.spec, self._att.tensors)

    def write(self, region: int, kernel_ids: Sequence[int], data: npt.NDArray[np.uint8]) -> None:
        """Write ``data[i]`` (``block_len`` bytes) into kernel block ``kernel_ids[i]``."""
        if self._pool is None:
            raise RuntimeError(f"{self.name}: the pool was closed")
        self._pool.write_blocks(region, kernel_ids, data)

    def close(self) -> None:
        """Detach (releasing anything still held) and drop the mappings."""
        with contextlib.suppress(KvxferdError):
            self._att.detach(force=True)
        self._pool = None  # the last references to the mapped memory go with these
        self._att.tensors.clear()
        self._client.close()
