"""Synchronous Engine-service client (see the package docstring)."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import grpc
import torch

from kvxferd.attach import ShmSegment, region_tensor
from kvxferd.engine.attachment import Attachment
from kvxferd.engine.errors import refused
from kvxferd.engine.shared import find_shared, shared_tensors
from kvxferd.engine.values import HoldTicket, PoolState, ReleaseEvent, pool_state
from kvxferd.errors import EngineDetached, InvalidRequest, KvxferdError, StateConflict
from kvxferd.ipc.host import device_ordinal, device_uuid
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.presets import preset as preset_spec
from kvxferd.layout.spec import KVCacheSpec, MemoryType
from kvxferd.v1 import engine_pb2, engine_pb2_grpc, spec_pb2
from kvxferd.wire.codec import (
    _DTYPE,
    spec_from_proto,
    spec_to_proto,
)

log = logging.getLogger(__name__)

Mode = Literal["owned", "imported"]
_OPEN_TIMEOUT_S = 30.0


class EngineClient:
    """Talks to the daemon's Engine service on ``socket_path`` (a Unix socket)."""

    def __init__(self, socket_path: str, *, token: str = "", timeout_s: float = 60.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = grpc.insecure_channel(f"unix:{socket_path}")
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        self._attachments: list[Attachment] = []  # their sessions end with the client

    def _call(self, method: str, req: Any) -> Any:
        try:
            return getattr(self._stub, method)(req, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise refused(exc, method) from None

    def describe(self) -> PoolState:
        p = self._call("Describe", engine_pb2.DescribeRequest()).pool
        return pool_state(p)

    def attach(
        self,
        spec_or_preset: KVCacheSpec | str,
        mode: Mode = "owned",
        device: str = "cpu",
        *,
        tensors: Mapping[str, torch.Tensor] | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        prefix_caching: bool = False,
    ) -> Attachment:
        """Attach the KV cache; returns once the pool is registered and the session is open.

        ``owned`` (the fast path): the daemon allocates; ``Attachment.tensors`` are mapped
        onto its memory (DRAM: shared memory; ``cuda:N``: CUDA IPC). ``imported``: pass the
        engine's own ``tensors``, one per region: DRAM from :func:`shared_tensors`; VRAM any
        CUDA tensors on ``device`` (e.g. the engine's KV cache), exported over CUDA IPC (the
        handle names the allocation a tensor sits in, the offset is its distance from the
        allocation's start). The daemon serves imported VRAM to same-host readers with KERNEL
        pulls only (never through NIXL, which reads it at 0.5-0.6 GB/s); see
        docs/attachment.md."""
        spec = preset_spec(spec_or_preset) if isinstance(spec_or_preset, str) else spec_or_preset
        memory = MemoryType.VRAM if device.startswith("cuda") else MemoryType.DRAM
        spec = spec.with_memory(memory)
        req = engine_pb2.AttachRequest(
            spec=spec_to_proto(spec),
            memory=spec_pb2.MEMORY_TYPE_VRAM
            if memory is MemoryType.VRAM
            else spec_pb2.MEMORY_TYPE_DRAM,
            tp_rank=tp_rank,
            tp_size=tp_size,
            prefix_caching=prefix_caching,
        )
        imported_shm: list[ShmSegment] = []
        if mode == "owned":
            if tensors is not None:
                raise InvalidRequest(
                    "OWNED attaches take no tensors: the daemon allocates them",
                    field="tensors",
                    fix="leave tensors out, or attach with mode='imported'",
                )
            req.memory_mode = engine_pb2.MEMORY_MODE_OWNED
        elif mode == "imported":
            if tensors is None:
                raise InvalidRequest(
                    "IMPORTED attaches need the engine's tensors",
                    field="tensors",
                    fix="pass tensors=shared_tensors(spec) (or CUDA tensors)",
                )
            req.memory_mode = engine_pb2.MEMORY_MODE_IMPORTED
            for r in spec.regions:
                t = tensors.get(r.name)
                if t is None:
                    raise InvalidRequest(
                        f"no tensor for region {r.name!r}",
                        field="tensors",
                        fix=f"pass one tensor per region: {[x.name for x in spec.regions]}",
                    )
                _check_device(r.name, t, device)
                req.imports.append(self._import_handle(r.name, t, imported_shm))
        else:
            raise InvalidRequest(f"unknown mode {mode!r}", field="mode", fix="owned or imported")
        pool = self._call("Attach", req).pool
        try:
            return self._attached(pool, mode, tensors, imported_shm)
        except BaseException as exc:
            # The daemon attached and this side failed (mapping, the session): the tensors
            # mapped so far live on in the failed frames, which the traceback keeps (each DRAM
            # region holds a descriptor), and the daemon would keep the pool, refusing every
            # other Attach, until pool.session_grace_ms passes. Let go of both now.
            traceback.clear_frames(exc.__traceback__)
            self._undo_attach(pool.attachment_id, exc)
            raise

    def _attached(
        self,
        pool: engine_pb2.PoolInfo,
        mode: Mode,
        tensors: Mapping[str, torch.Tensor] | None,
        imported_shm: list[ShmSegment],
    ) -> Attachment:
        """The attachment the daemon made: its exports mapped (OWNED), its session open."""
        got = spec_from_proto(pool.spec, "pool.spec")
        att = Attachment(
            self,
            pool.attachment_id,
            pool.registration_generation,
            "OWNED" if mode == "owned" else "IMPORTED",
            got,
            pool.peer_address,
            dict(tensors) if tensors is not None else _map_exports(got, pool.exports),
            _owned_shm=imported_shm,
        )
        self._open_session(att)
        return att

    def _undo_attach(self, attachment_id: str, exc: BaseException) -> None:
        """Detach what the daemon attached for an ``attach`` that then failed here."""
        try:
            self._call("Detach", engine_pb2.DetachRequest(force=True, attachment_id=attachment_id))
        except (EngineDetached, StateConflict):
            pass  # the daemon has let go of it already (or another engine attached since)
        except KvxferdError as err:
            exc.add_note(
                f"the daemon keeps attachment {attachment_id} until pool.session_grace_ms"
                f" passes (detaching it failed too: {err})"
            )

    def _import_handle(
        self, region: str, t: torch.Tensor, shm: list[ShmSegment]
    ) -> engine_pb2.MemoryHandle:
        dtype = KVDType.from_torch_name(str(t.dtype))
        h = engine_pb2.MemoryHandle(
            region_name=region,
            shape=list(t.shape),
            strides=list(t.stride()),
            dtype=_DTYPE[dtype],
        )
        if t.device.type == "cuda":
            from kvxferd.attach.cuda_ipc import export_tensor

            nbytes = int(t.untyped_storage().nbytes() - t.storage_offset() * t.element_size())
            ex = export_tensor(t, nbytes)
            h.cuda_ipc_handle = ex.handle
            h.offset = ex.offset
            h.nbytes = ex.nbytes
            h.device_id = ex.device
            h.device_uuid = device_uuid(ex.device) or ""  # the daemon finds the GPU by it
            return h
        seg, offset = find_shared(t, f"tensor of region {region!r}")
        shm.append(seg)
        h.shm_name = seg.name
        h.offset = offset
        h.nbytes = seg.size - offset
        return h

    def _open_session(self, att: Attachment) -> None:
        call: Any = self._stub.Session(
            engine_pb2.SessionRequest(attachment_id=att.attachment_id), metadata=self._metadata
        )
        try:
            first = next(iter(call), None)
        except grpc.RpcError as exc:
            raise refused(exc, "Session") from None
        if first is None or first.WhichOneof("event") != "opened":
            call.cancel()  # a stream still open would outlive the attach that failed
            raise EngineDetached("the session did not open", fix="check the daemon's log")
        att._call = call
        att._thread = threading.Thread(
            target=att._run_session, args=(call,), name="kvxferd-session", daemon=True
        )
        att._thread.start()
        self._attachments = [a for a in self._attachments if a.attached]
        self._attachments.append(att)

    def close(self) -> None:
        """Close the channel, ending first the session of each attachment still attached
        (as the channel's close would break it), its thread joined."""
        for att in self._attachments:
            att._end("the engine client was closed")
        self._attachments = []
        self._channel.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_device(region: str, t: torch.Tensor, device: str) -> None:
    """An IMPORTED tensor lives where the attach says the pool lives."""
    want = torch.device(device)
    if want.type == "cuda" and want.index is None:
        want = torch.device("cuda", 0)
    if t.device != want:
        raise InvalidRequest(
            f"the tensor of region {region!r} is on {t.device}, but the attach is for {device}",
            field="tensors",
            fix="pass device= the device every tensor is on (cuda:N for VRAM, cpu for shared"
            " memory)",
        )


def _map_exports(
    spec: KVCacheSpec, exports: Sequence[engine_pb2.MemoryHandle]
) -> dict[str, torch.Tensor]:
    """Map the daemon's OWNED exports into this process as the spec's tensors (a failure
    part-way leaves the tensors made so far to the caller's ``traceback.clear_frames``)."""
    out = {}
    for r, h in zip(spec.regions, exports, strict=True):
        if h.WhichOneof("handle") == "cuda_ipc_handle":
            from kvxferd.attach.cuda_ipc import IpcMapping

            ordinal = export_ordinal(h)
            raw = IpcMapping(h.cuda_ipc_handle, ordinal).tensor(h.offset, r.nbytes)
        else:
            raw = ShmSegment.open(h.shm_name, who="engine").tensor(h.offset, r.nbytes)
        out[r.name] = region_tensor(r, raw)
    return out


def export_ordinal(
    h: engine_pb2.MemoryHandle, ordinal_of: Callable[[str], int | None] = device_ordinal
) -> int:
    """This process's CUDA ordinal of the GPU a daemon's VRAM export is on: found by the GPU's
    UUID (``ordinal_of``), since the daemon and the engine may number GPUs differently
    (CUDA_VISIBLE_DEVICES); the daemon's ordinal only when it sends no UUID (an older
    daemon, or a driver that reports none)."""
    if not h.device_uuid:
        return int(h.device_id)
    mine = ordinal_of(h.device_uuid)
    if mine is None:
        raise InvalidRequest(
            f"the daemon's KV pool is on GPU {h.device_uuid} (its cuda:{h.device_id}), which"
            " this process does not see",
            field="exports.device_uuid",
            fix="give the engine that GPU (CUDA_VISIBLE_DEVICES), or run the daemon on one of"
            " the engine's GPUs (pool.device)",
        )
    return mine


def wait_registered(client: EngineClient, timeout_s: float = _OPEN_TIMEOUT_S) -> PoolState:
    """Poll Describe until a pool is registered (tests and tools)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = client.describe()
        if st.state == "REGISTERED" or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


__all__ = [
    "Attachment",
    "EngineClient",
    "HoldTicket",
    "PoolState",
    "ReleaseEvent",
    "shared_tensors",
    "wait_registered",
]
