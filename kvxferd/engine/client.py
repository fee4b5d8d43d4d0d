"""Synchronous Engine-service client (see the package docstring)."""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import grpc
import torch

from kvxferd.attach import ShmSegment, region_tensor
from kvxferd.errors import EngineDetached, InvalidRequest, KvxferdError
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.presets import preset as preset_spec
from kvxferd.layout.spec import KVCacheSpec, MemoryType
from kvxferd.v1 import common_pb2, engine_pb2, engine_pb2_grpc, spec_pb2
from kvxferd.wire.codec import (
    _DTYPE,
    group_ids_from_proto,
    group_ids_to_proto,
    spec_from_proto,
    spec_to_proto,
)

log = logging.getLogger(__name__)

Mode = Literal["owned", "imported"]
_OPEN_TIMEOUT_S = 30.0
_REASONS = {v: k.removeprefix("RELEASE_REASON_") for k, v in common_pb2.ReleaseReason.items()}


def _raise(exc: grpc.RpcError, what: str) -> KvxferdError:
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    from kvxferd import errors as e

    cls: type[KvxferdError] = {
        grpc.StatusCode.INVALID_ARGUMENT: e.InvalidRequest,
        grpc.StatusCode.ALREADY_EXISTS: e.AlreadyExists,
        grpc.StatusCode.NOT_FOUND: e.NotFound,
        grpc.StatusCode.FAILED_PRECONDITION: e.LeaseRefused,
        grpc.StatusCode.UNAVAILABLE: e.PeerUnavailable,
        grpc.StatusCode.RESOURCE_EXHAUSTED: e.ResourceExhausted,
        grpc.StatusCode.UNAUTHENTICATED: e.Unauthenticated,
    }.get(code, e.KvxferdError)  # type: ignore[arg-type]
    name = code.name if code is not None else "ERROR"
    return cls(f"{what} refused by the daemon ({name}): {detail}")


@dataclass(frozen=True)
class HoldTicket:
    """What the scheduler passes to the decode side's StartPull (same field names)."""

    peer_address: str
    request_id: str
    remote_block_ids: tuple[tuple[int, ...], ...]
    expires_unix_ns: int

    def to_json(self) -> dict[str, Any]:
        return {
            "peer_address": self.peer_address,
            "request_id": self.request_id,
            "remote_block_ids": [list(g) for g in self.remote_block_ids],
            "expires_unix_ns": self.expires_unix_ns,
        }


@dataclass(frozen=True)
class ReleaseEvent:
    """A held request's blocks may be reused. ``reason``: DONE, EXPIRED, CANCELLED or
    ENGINE_DETACHED."""

    request_id: str
    reason: str
    block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class PoolState:
    """Describe's answer, in short."""

    state: str  # DETACHED, REGISTERING or REGISTERED
    mode: str  # OWNED, IMPORTED or "" when detached
    generation: int
    attachment_id: str
    held_requests: int
    peer_address: str


# -- shared host memory for IMPORTED attaches ----------------------------------------------------

_SHARED: dict[int, tuple[int, ShmSegment]] = {}  # base address -> (size, segment)
_SHARED_LOCK = threading.Lock()


def shared_tensors(spec: KVCacheSpec, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Allocate ``spec``'s regions where the daemon can import them (IMPORTED mode).

    ``cpu``: one POSIX shared-memory segment per region (unlinked when detached, or at exit);
    ``cuda:N``: ordinary torch allocations (the daemon refuses to import them: attach OWNED).
    """
    if device.startswith("cuda"):
        from kvxferd.layout.alloc import allocate_pool

        return allocate_pool(spec.with_memory(MemoryType.VRAM), device)
    out = {}
    tag = f"kvxferd-engine-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    for i, r in enumerate(spec.regions):
        seg = ShmSegment.create(f"{tag}-{i}", r.nbytes)
        raw = seg.tensor(0, r.nbytes)
        with _SHARED_LOCK:
            _SHARED[int(raw.data_ptr())] = (seg.size, seg)
        out[r.name] = region_tensor(r, raw)
    return out


def _unlink_shared(segments: Sequence[ShmSegment]) -> None:
    for seg in segments:
        seg.unlink()


@atexit.register
def _unlink_all_shared() -> None:
    with _SHARED_LOCK:
        segs = [s for _, s in _SHARED.values()]
    _unlink_shared(segs)


def _find_shared(t: torch.Tensor, what: str) -> tuple[ShmSegment, int]:
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


@dataclass
class Attachment:
    """A live attachment: tensors mapped on the shared memory, hold, releases, detach."""

    client: EngineClient
    attachment_id: str
    generation: int
    mode: str
    spec: KVCacheSpec
    peer_address: str
    tensors: dict[str, torch.Tensor]
    _releases: queue.Queue[ReleaseEvent | None] = field(default_factory=queue.Queue)
    _callbacks: list[Callable[[ReleaseEvent], None]] = field(default_factory=list)
    _ended: threading.Event = field(default_factory=threading.Event)
    _end_reason: str = ""
    _call: Any = None
    _thread: threading.Thread | None = None
    _owned_shm: list[ShmSegment] = field(default_factory=list)

    @property
    def attached(self) -> bool:
        return not self._ended.is_set()

    @property
    def end_reason(self) -> str:
        return self._end_reason

    def hold(
        self,
        request_id: str,
        block_ids_per_group: Sequence[Sequence[int]],
        readers: int = 1,
        ttl_s: float | None = None,
        *,
        sync: bool = True,
    ) -> HoldTicket:
        """Hold a finished request's logical block IDs (one list per KV group) for readers.

        ``sync``: for VRAM, wait for this process's GPU work first so that readers see the
        final bytes (pass False if the engine already synchronised, e.g. with an event)."""
        if self._ended.is_set():
            raise EngineDetached(
                f"attachment {self.attachment_id} ended: {self._end_reason}",
                fix="attach again before holding",
            )
        if sync and self.spec.regions[0].memory is MemoryType.VRAM:
            torch.cuda.synchronize(next(iter(self.tensors.values())).device)
        req = engine_pb2.HoldRequest(
            request_id=request_id,
            block_ids=group_ids_to_proto([list(map(int, g)) for g in block_ids_per_group]),
            expected_readers=readers,
            ttl_ms=int((ttl_s or 0) * 1000),
        )
        resp = self.client._call("Hold", req)
        return HoldTicket(
            resp.peer_address,
            resp.request_id,
            tuple(tuple(int(x) for x in g) for g in group_ids_from_proto(resp.remote_block_ids)),
            resp.expires_unix_ns,
        )

    def on_release(self, callback: Callable[[ReleaseEvent], None]) -> None:
        """Call ``callback`` (on the session thread) for every release from now on."""
        self._callbacks.append(callback)

    def releases(self, timeout_s: float | None = None) -> Iterator[ReleaseEvent]:
        """Release events as they arrive; ends when the attachment ends (or after
        ``timeout_s`` without one)."""
        while True:
            try:
                ev = self._releases.get(timeout=timeout_s)
            except queue.Empty:
                return
            if ev is None:
                self._releases.put(None)  # let other iterators end too
                return
            yield ev

    def detach(self, *, force: bool = True) -> int:
        """Detach (the daemon deregisters and drops the pool); returns released requests.
        The tensors must not be used afterwards."""
        if self._ended.is_set():
            return 0
        resp = self.client._call(
            "Detach", engine_pb2.DetachRequest(force=force, attachment_id=self.attachment_id)
        )
        self._end("detached by the engine")
        return int(resp.released_requests)

    def _end(self, why: str) -> None:
        if self._ended.is_set():
            return
        self._end_reason = why
        self._ended.set()
        if self._call is not None:
            self._call.cancel()
        self._releases.put(None)
        segs = self._owned_shm
        self._owned_shm = []
        _unlink_shared(segs)
        with _SHARED_LOCK:
            for base, (_, seg) in list(_SHARED.items()):
                if seg in segs:
                    del _SHARED[base]

    def _run_session(self, stream: Iterator[engine_pb2.SessionResponse]) -> None:
        why = "the daemon closed the session"
        try:
            for msg in stream:
                if msg.WhichOneof("event") != "release":
                    continue
                r = msg.release
                ev = ReleaseEvent(
                    r.request_id,
                    _REASONS.get(r.reason, str(r.reason)),
                    tuple(tuple(int(x) for x in g) for g in group_ids_from_proto(r.block_ids)),
                )
                self._releases.put(ev)
                for cb in list(self._callbacks):
                    try:
                        cb(ev)
                    except Exception:
                        log.exception("release callback failed")
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code != grpc.StatusCode.CANCELLED:
                why = f"the session broke: {exc}"
        self._end(why)

    def __enter__(self) -> Attachment:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._ended.is_set():
            try:
                self.detach(force=True)
            except KvxferdError as err:
                log.warning("detach on exit failed: %s", err)
                self._end("closed")


class EngineClient:
    """Talks to the daemon's Engine service on ``socket_path`` (a Unix socket)."""

    def __init__(self, socket_path: str, *, token: str = "", timeout_s: float = 60.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = grpc.insecure_channel(f"unix:{socket_path}")
        self._stub = engine_pb2_grpc.EngineStub(self._channel)

    def _call(self, method: str, req: Any) -> Any:
        try:
            return getattr(self._stub, method)(req, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _raise(exc, method) from None

    def describe(self) -> PoolState:
        p = self._call("Describe", engine_pb2.DescribeRequest()).pool
        return _state(p)

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
        onto its memory (DRAM: shared memory; ``cuda:N``: CUDA IPC). ``imported``: pass
        ``tensors`` from :func:`shared_tensors` (DRAM only: the daemon refuses IMPORTED VRAM,
        which reads at 0.5-0.6 GB/s once registered; see docs/attachment.md)."""
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
                req.imports.append(self._import_handle(r.name, t, imported_shm))
        else:
            raise InvalidRequest(f"unknown mode {mode!r}", field="mode", fix="owned or imported")
        pool = self._call("Attach", req).pool
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
            return h
        seg, offset = _find_shared(t, f"tensor of region {region!r}")
        shm.append(seg)
        h.shm_name = seg.name
        h.offset = offset
        h.nbytes = seg.size - offset
        return h

    def _open_session(self, att: Attachment) -> None:
        call = self._stub.Session(
            engine_pb2.SessionRequest(attachment_id=att.attachment_id), metadata=self._metadata
        )
        try:
            first = next(iter(call), None)
        except grpc.RpcError as exc:
            raise _raise(exc, "Session") from None
        if first is None or first.WhichOneof("event") != "opened":
            raise EngineDetached("the session did not open", fix="check the daemon's log")
        att._call = call
        att._thread = threading.Thread(
            target=att._run_session, args=(call,), name="kvxferd-session", daemon=True
        )
        att._thread.start()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _state(p: engine_pb2.PoolInfo) -> PoolState:
    return PoolState(
        state=engine_pb2.RegistrationState.Name(p.state).removeprefix("REGISTRATION_STATE_"),
        mode=""
        if p.state != engine_pb2.REGISTRATION_STATE_REGISTERED
        else engine_pb2.MemoryMode.Name(p.memory_mode).removeprefix("MEMORY_MODE_"),
        generation=p.registration_generation,
        attachment_id=p.attachment_id,
        held_requests=p.held_requests,
        peer_address=p.peer_address,
    )


def _map_exports(
    spec: KVCacheSpec, exports: Sequence[engine_pb2.MemoryHandle]
) -> dict[str, torch.Tensor]:
    """Map the daemon's OWNED exports into this process as the spec's tensors."""
    out = {}
    for r, h in zip(spec.regions, exports, strict=True):
        if h.WhichOneof("handle") == "cuda_ipc_handle":
            from kvxferd.attach.cuda_ipc import IpcMapping

            raw = IpcMapping(h.cuda_ipc_handle, h.device_id).tensor(h.offset, r.nbytes)
        else:
            raw = ShmSegment.open(h.shm_name).tensor(h.offset, r.nbytes)
        out[r.name] = region_tensor(r, raw)
    return out


def wait_registered(client: EngineClient, timeout_s: float = _OPEN_TIMEOUT_S) -> PoolState:
    """Poll Describe until a pool is registered (tests and tools)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = client.describe()
        if st.state == "REGISTERED" or time.monotonic() > deadline:
            return st
        time.sleep(0.05)
