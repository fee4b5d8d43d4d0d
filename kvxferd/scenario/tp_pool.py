"""An engine's KV pool attached to one scenario daemon, with its bytes writable.

The TP scenario plays each rank's engine: it attaches an OWNED pool of the rank's spec and
TP position over the daemon's Engine service (``Attach``, then the ``Session`` stream that
keeps the attachment alive), maps the memory the daemon exports (shared memory for DRAM, CUDA
IPC for VRAM on the daemon's GPU), and writes blocks straight into it, as a model computing
its KV cache would. (``kvxferd.engine`` has the full
engine client; the scenario floor cannot import it, and needs only this much.)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import grpc
import numpy as np
import numpy.typing as npt
import torch

from kvxferd.attach import ShmSegment
from kvxferd.layout.spec import KVCacheSpec
from kvxferd.scenario.client import CALL_TIMEOUT_S, rpc_failure
from kvxferd.v1 import engine_pb2, engine_pb2_grpc, spec_pb2
from kvxferd.wire.codec import spec_from_proto, spec_to_proto


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
        self._md: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self._channel = grpc.insecure_channel(f"unix:{engine_socket}")
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        req = engine_pb2.AttachRequest(
            spec=spec_to_proto(spec),
            memory_mode=engine_pb2.MEMORY_MODE_OWNED,
            memory=spec_pb2.MEMORY_TYPE_VRAM if vram else spec_pb2.MEMORY_TYPE_DRAM,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        try:
            pool = self._stub.Attach(req, timeout=CALL_TIMEOUT_S, metadata=self._md).pool
        except grpc.RpcError as exc:
            self._channel.close()
            raise rpc_failure(f"{name} Attach", exc) from None
        self.attachment_id = pool.attachment_id
        self.spec = spec_from_proto(pool.spec, where=f"{name}.pool.spec")
        self.peer_address = pool.peer_address
        self._rows: list[torch.Tensor] = []
        for r, h in zip(self.spec.regions, pool.exports, strict=True):
            if vram:
                from kvxferd.attach.cuda_ipc import IpcMapping

                raw = IpcMapping(h.cuda_ipc_handle, h.device_id).tensor(h.offset, r.nbytes)
            else:
                raw = ShmSegment.open(h.shm_name).tensor(h.offset, r.nbytes)
            self._rows.append(raw.view(r.num_blocks, r.stride))
        self._session = self._stub.Session(
            engine_pb2.SessionRequest(attachment_id=self.attachment_id), metadata=self._md
        )
        try:
            first = next(iter(self._session))
        except grpc.RpcError as exc:
            raise rpc_failure(f"{name} Session", exc) from None
        if first.WhichOneof("event") != "opened":
            raise RuntimeError(f"{name}: the engine session did not open ({first})")
        self._thread = threading.Thread(target=self._drain, name=f"session-{name}", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            for _ in self._session:
                pass

    def write(self, region: int, kernel_ids: Sequence[int], data: npt.NDArray[np.uint8]) -> None:
        """Write ``data[i]`` (``block_len`` bytes) into kernel block ``kernel_ids[i]``."""
        rows = self._rows[region]
        width = self.spec.regions[region].block_len
        idx = torch.as_tensor(np.asarray(kernel_ids, dtype=np.int64), device=rows.device)
        rows[idx, :width] = torch.from_numpy(np.ascontiguousarray(data)).to(rows.device)
        if rows.is_cuda:
            torch.cuda.synchronize(rows.device)  # in place before the prefill is held

    def close(self) -> None:
        """Detach (releasing anything still held) and drop the mappings."""
        with contextlib.suppress(grpc.RpcError):
            self._stub.Detach(
                engine_pb2.DetachRequest(force=True, attachment_id=self.attachment_id),
                timeout=CALL_TIMEOUT_S,
                metadata=self._md,
            )
        self._session.cancel()  # type: ignore[no-untyped-call]
        self._thread.join(5)
        self._rows.clear()
        self._channel.close()
