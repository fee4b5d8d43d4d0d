"""The connector's calls to its local daemon (no vLLM import).

:class:`EngineLink` speaks the Engine service on the daemon's Unix socket: it attaches the
engine's KV memory IMPORTED (host memory: vLLM's backing buffer lives in a POSIX shared-memory
segment the connector created, see :mod:`kvxferd.vllm.memory`; VRAM: CUDA IPC handles of the
allocation vLLM made on its GPU, see :mod:`kvxferd.vllm.gpu`), keeps the ``Session`` open and
delivers its release events, and holds finished prompts. The Scheduler side, pulls, is
:mod:`kvxferd.vllm.pull_link`.

Every failure is turned into :class:`~kvxferd.errors.KvxferdError` carrying the daemon's own
explanation (the gRPC status and, when sent, the mismatches of an incompatible peer).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvxferd.errors import EngineDetached, KvxferdError
from kvxferd.layout.spec import KVCacheSpec
from kvxferd.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    scheduler_pb2,
    spec_pb2,
)
from kvxferd.wire.codec import (
    _DTYPE,
    group_ids_to_proto,
    spec_to_proto,
)
from kvxferd.wire.peer_client import RpcFailure

log = logging.getLogger("kvxferd.vllm")

DOC = "docs/vllm.md"
ERROR_TRAILER = "kvxferd-error-bin"
CALL_TIMEOUT_S = 30.0
TERMINAL = frozenset(
    {
        scheduler_pb2.TRANSFER_STATE_DONE,
        scheduler_pb2.TRANSFER_STATE_FAILED,
        scheduler_pb2.TRANSFER_STATE_CANCELLED,
        scheduler_pb2.TRANSFER_STATE_EXPIRED,
    }
)
_REASONS = {v: k.removeprefix("RELEASE_REASON_") for k, v in common_pb2.ReleaseReason.items()}


def explain(detail: common_pb2.ErrorDetail) -> str:
    """One line: the daemon's message, every mismatch (unless the message lists them already)
    and its fix."""
    parts = [detail.message or "(no message)"]
    if "mismatch" not in detail.message:
        for m in detail.mismatches:
            fix = f" ({m.fix})" if m.fix else ""
            parts.append(f"{m.what}: local {m.local}, remote {m.remote}{fix}")
    if detail.fix and not detail.mismatches:
        parts.append(f"fix: {detail.fix}")
    return "; ".join(parts)


def rpc_error(method: str, where: str, exc: grpc.RpcError) -> KvxferdError:
    """A failed call as a KvxferdError with the daemon's explanation."""
    shaped = isinstance(exc, grpc.Call | RpcFailure)  # RpcFailure: the scheduler socket's
    code = exc.code() if shaped else None
    text = exc.details() if shaped else str(exc)
    if shaped:
        trailer: Any = exc.trailing_metadata() or ()
        for key, value in trailer:
            if key == ERROR_TRAILER and isinstance(value, bytes):
                with contextlib.suppress(Exception):
                    text = explain(common_pb2.ErrorDetail.FromString(value))
    name = code.name if code is not None else "ERROR"
    if code == grpc.StatusCode.UNAVAILABLE:
        fix = f"start the kvxferd daemon beside this engine, or fix the address {where}"
    elif code == grpc.StatusCode.FAILED_PRECONDITION:
        fix = "serve the same model with the same KV cache layout on both engines"
    else:
        fix = "read the daemon's log"
    return KvxferdError(f"{method} at {where} failed ({name}): {text}", fix=f"{fix} (see {DOC})")


def _metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


@dataclass(frozen=True)
class Release:
    """A held request's blocks may be reused (reason DONE, EXPIRED, CANCELLED or
    ENGINE_DETACHED)."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class Import:
    """One region of an IMPORTED attach: where its bytes are in the shared memory (DRAM:
    ``shm_name``) or in the engine's CUDA allocation (VRAM: ``cuda_ipc_handle`` of the
    allocation on ``device_id``, ``offset`` bytes in; ``device_uuid`` names that GPU for the
    daemon, whose CUDA ordinals may differ)."""

    region: str
    shm_name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    cuda_ipc_handle: bytes = b""
    device_id: int = 0
    device_uuid: str = ""


class EngineLink:
    """The Engine service on ``socket_path``."""

    def __init__(self, socket_path: str, *, token: str = "") -> None:
        self.socket_path = socket_path
        self._md = _metadata(token)
        self._channel = grpc.insecure_channel(f"unix:{socket_path}")
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        self._session: Any = None
        self._thread: threading.Thread | None = None
        self.attachment_id = ""
        self.peer_address = ""
        self.ended = threading.Event()
        self.end_reason = ""

    def _call(self, method: str, req: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        try:
            return getattr(self._stub, method)(req, timeout=timeout_s, metadata=self._md)
        except grpc.RpcError as exc:
            raise rpc_error(f"Engine.{method}", f"unix:{self.socket_path}", exc) from None

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for the daemon's socket to answer (the daemon may start after the engine)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._call("Describe", engine_pb2.DescribeRequest(), timeout_s=5.0)
                return
            except KvxferdError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def attach(
        self,
        spec: KVCacheSpec,
        imports: Sequence[Import],
        *,
        tp_rank: int,
        tp_size: int,
        prefix_caching: bool,
        on_release: Callable[[Release], None],
    ) -> engine_pb2.PoolInfo:
        """Attach IMPORTED memory and open the session; releases go to ``on_release`` (on the
        session thread). Host memory when the imports name shared memory; VRAM (served by
        same-host KERNEL pulls only, docs/attachment.md) when they carry CUDA IPC handles."""
        vram = any(imp.cuda_ipc_handle for imp in imports)
        req = engine_pb2.AttachRequest(
            spec=spec_to_proto(spec),
            memory_mode=engine_pb2.MEMORY_MODE_IMPORTED,
            memory=spec_pb2.MEMORY_TYPE_VRAM if vram else spec_pb2.MEMORY_TYPE_DRAM,
            tp_rank=tp_rank,
            tp_size=tp_size,
            prefix_caching=prefix_caching,
        )
        for r, imp in zip(spec.regions, imports, strict=True):
            h = engine_pb2.MemoryHandle(
                region_name=imp.region,
                offset=imp.offset,
                nbytes=imp.nbytes,
                shape=list(imp.shape),
                strides=list(imp.strides),
                dtype=_DTYPE[r.dtype],
            )
            if vram:
                h.cuda_ipc_handle = imp.cuda_ipc_handle
                h.device_id = imp.device_id
                h.device_uuid = imp.device_uuid
            else:
                h.shm_name = imp.shm_name
            req.imports.append(h)
        pool = self._call("Attach", req).pool
        self.attachment_id = pool.attachment_id
        self.peer_address = pool.peer_address
        call = self._stub.Session(
            engine_pb2.SessionRequest(attachment_id=pool.attachment_id), metadata=self._md
        )
        try:
            first = next(iter(call), None)
        except grpc.RpcError as exc:
            raise rpc_error("Engine.Session", f"unix:{self.socket_path}", exc) from None
        if first is None or first.WhichOneof("event") != "opened":
            raise EngineDetached(
                "the daemon did not open the engine session", fix="read the daemon's log"
            )
        self._session = call
        self._thread = threading.Thread(
            target=self._run_session, args=(call, on_release), name="kvxferd-session", daemon=True
        )
        self._thread.start()
        return pool  # type: ignore[no-any-return]

    def _run_session(self, call: Any, on_release: Callable[[Release], None]) -> None:
        why = "the daemon closed the engine session"
        try:
            for msg in call:
                if msg.WhichOneof("event") != "release":
                    continue
                r = msg.release
                try:
                    on_release(Release(r.request_id, _REASONS.get(r.reason, str(r.reason))))
                except Exception:
                    log.exception("kvxferd: handling the release of %s failed", r.request_id)
        except grpc.RpcError as exc:
            if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.CANCELLED:
                why = "closed by the engine"
            else:
                why = f"the engine session broke: {exc}"
        self.end_reason = why
        self.ended.set()

    def hold(
        self,
        request_id: str,
        block_ids: Sequence[Sequence[int]],
        *,
        readers: int,
        ttl_ms: int,
        timeout_s: float = CALL_TIMEOUT_S,
    ) -> engine_pb2.HoldResponse:
        req = engine_pb2.HoldRequest(
            request_id=request_id,
            block_ids=group_ids_to_proto([list(g) for g in block_ids]),
            expected_readers=readers,
            ttl_ms=ttl_ms,
        )
        return self._call("Hold", req, timeout_s)  # type: ignore[no-any-return]

    def describe(self) -> engine_pb2.PoolInfo:
        return self._call("Describe", engine_pb2.DescribeRequest()).pool  # type: ignore[no-any-return]

    def detach(self) -> None:
        if self.attachment_id and not self.ended.is_set():
            with contextlib.suppress(KvxferdError):
                self._call(
                    "Detach",
                    engine_pb2.DetachRequest(force=True, attachment_id=self.attachment_id),
                    timeout_s=10.0,
                )
        if self._session is not None:
            self._session.cancel()
        if self._thread is not None:
            self._thread.join(5.0)
        self.ended.set()

    def close(self) -> None:
        self.detach()
        self._channel.close()
