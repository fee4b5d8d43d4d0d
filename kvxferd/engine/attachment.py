"""A live attachment: the engine's tensors on the daemon's memory, holds, releases, detach."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc
import torch

from kvxferd.attach import ShmSegment
from kvxferd.engine.shared import forget_shared
from kvxferd.engine.values import HoldTicket, ReleaseEvent
from kvxferd.errors import EngineDetached, KvxferdError
from kvxferd.layout.spec import KVCacheSpec, MemoryType
from kvxferd.logs import kv
from kvxferd.v1 import common_pb2, engine_pb2
from kvxferd.wire.codec import group_ids_from_proto, group_ids_to_proto

if TYPE_CHECKING:
    from kvxferd.engine.client import EngineClient

log = logging.getLogger(__name__)

_REASONS = {v: k.removeprefix("RELEASE_REASON_") for k, v in common_pb2.ReleaseReason.items()}


# How long ending an attachment waits for its session thread to leave the cancelled stream.
SESSION_JOIN_S = 5.0


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
        forget_shared(segs)
        # The session's thread leaves gRPC's stream before we return: a process that exits
        # with a thread still inside a gRPC call can abort in gRPC's native teardown
        # ("terminate called without an active exception").
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(SESSION_JOIN_S)

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
                log.warning("detach on exit failed", extra=kv(error=str(err)))
                self._end("closed")


__all__ = ["Attachment"]
