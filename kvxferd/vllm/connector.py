"""``KvxferdConnector``: vLLM's KV connector (V1 API) backed by the kvxferd daemon beside it.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvxferdConnector",
      "kv_connector_module_path": "kvxferd.vllm.connector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"engine_socket": "/run/kvxferd/engine.sock"}}'

This is the only module of kvxferd that imports vLLM; vLLM imports it. What each side does:

* **worker**: on the CPU backend ``get_mem_pool_context`` makes vLLM allocate its KV cache in
  shared memory (:mod:`kvxferd.vllm.memory`) and ``register_kv_caches`` translates the KV cache
  config into a kvxferd spec (:mod:`kvxferd.vllm.spec`) and attaches that memory to the daemon
  (IMPORTED host memory); on a GPU vLLM allocates its CUDA KV cache itself and
  ``register_kv_caches`` attaches it IMPORTED VRAM, served to same-host readers with KERNEL
  pulls (:mod:`kvxferd.vllm.gpu`); the engine session stays open; ``start_load_kv`` starts the
  pulls the scheduler side planned; ``get_finished`` reports finished pulls and the prefills
  whose lease the daemon released; ``get_block_ids_with_load_errors`` reports the blocks of
  failed pulls, so vLLM's ``kv_load_failure_policy`` (recompute or fail) applies.
* **scheduler**: a finished prefill (``kv_transfer_params`` with ``do_remote_decode``) is held
  on the daemon under a lease and its ticket returned as the request's ``kv_transfer_params``
  (:mod:`kvxferd.vllm.params`); a decode request carrying a ticket reports the prompt's missing
  tokens as loadable and, once vLLM allocated its blocks, pairs them with the held ones
  position by position, so prefix-cache hits move only the missing blocks.

Configuration (``kv_connector_extra_config``), errors and limits: docs/vllm.md.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.logger import init_logger

from kvxferd.errors import KvxferdError
from kvxferd.vllm.daemon import EngineLink, PullLink, PullResult, Release
from kvxferd.vllm.gpu import attach_cuda
from kvxferd.vllm.kinds import resolved_layout, see_doc
from kvxferd.vllm.memory import SharedKvAllocation
from kvxferd.vllm.params import (
    LocalBlock,
    PullJob,
    Ticket,
    blocks_to_hold,
    plan_pull,
    ticket_from_params,
)
from kvxferd.vllm.settings import ConnectorSettings, attn_backend
from kvxferd.vllm.spec import (
    check_views,
    kernel_block_sizes,
    region_strides,
    transfer_groups,
    translate,
)

# A child of the "vllm" logger: our lines go through vLLM's handler, format and level.
log = init_logger("vllm.kvxferd")

_SEEN_MAX = 65536


@dataclass
class KvxferdMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> worker, once per step: the pulls to start."""

    pulls: list[PullJob] = field(default_factory=list)


class KvxferdConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM KV connector that moves KV blocks through kvxferd daemons (see the module doc)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.from_vllm_config(vllm_config)
        self._tp_size = 1
        self._ttl_ms = settings.hold_ttl_ms
        self._deadline_ms = settings.pull_deadline_ms
        self._daemon_wait_s = settings.daemon_wait_s
        self._fingerprint = settings.fingerprint
        self._groups = transfer_groups(kv_cache_config)
        self._kinds = [g.kind for g in self._groups]
        self._engine_id = settings.engine_id
        self._engine = EngineLink(settings.engine_socket, token=settings.token)
        self._token = settings.token
        self._lock = threading.Lock()
        # scheduler side
        self._pending: list[PullJob] = []
        self._planned: set[str] = set()
        # worker side
        self._alloc = SharedKvAllocation()
        self._pull: PullLink | None = None
        self._started: set[str] = set()
        self._notify_only: set[str] = set()
        self._done_recv: set[str] = set()
        self._load_errors: set[int] = set()
        self._released: set[str] = set()
        self._finished_seen: OrderedDict[str, None] = OrderedDict()
        self.attached_bytes = 0

    # ---- worker side -------------------------------------------------------------------------

    def get_mem_pool_context(self) -> Any:
        from vllm.platforms import current_platform

        return self._alloc if current_platform.is_cpu() else None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            self._register_cuda(kv_caches)
            return
        seg, buf = self._alloc.require()
        kcfg = self._kv_cache_config
        kernel = kernel_block_sizes(kcfg, kv_caches)
        translated = translate(
            kcfg,
            model=self._fingerprint,
            layout=resolved_layout(self._vllm_config, kcfg),
            kernel_block_sizes=kernel,
            backend=attn_backend(self._vllm_config, kv_caches)[1],
            tp_size=self._tp_size,
            cache_dtype=str(self._vllm_config.cache_config.cache_dtype),
        )
        check_views(
            translated, int(buf.data_ptr()), {n: int(t.data_ptr()) for n, t in kv_caches.items()}
        )
        from kvxferd.vllm.daemon import Import

        imports = [
            Import(
                r.name,
                seg.name,
                translated.placement(r.name).offset,
                r.nbytes,
                r.shape,
                region_strides(r),
            )
            for r in translated.spec.regions
        ]
        try:
            self._engine.wait_ready(self._daemon_wait_s)
            pool = self._engine.attach(
                translated.spec,
                imports,
                tp_rank=0,
                tp_size=self._tp_size,
                prefix_caching=bool(self._vllm_config.cache_config.enable_prefix_caching),
                on_release=self._on_release,
            )
        except KvxferdError as err:
            msg = f"attaching the KV cache to the daemon at unix:{self._engine.socket_path}"
            raise RuntimeError(see_doc(f"KvxferdConnector: {msg} failed: {err}")) from None
        finally:
            self._alloc.unlink()
        self._pull = PullLink(pool.peer_address, token=self._token)
        self.attached_bytes = translated.spec.nbytes
        log.info(
            "kvxferd: attached %d bytes of KV cache (%s) to the daemon at %s as attachment %s",
            translated.spec.nbytes,
            translated.page_format,
            pool.peer_address,
            pool.attachment_id,
        )

    def _register_cuda(self, kv_caches: dict[str, Any]) -> None:
        """GPU: vLLM's own CUDA KV cache, attached IMPORTED VRAM (served by same-host KERNEL
        pulls; :mod:`kvxferd.vllm.gpu`)."""
        kcfg = self._kv_cache_config
        backend, name = attn_backend(self._vllm_config, kv_caches)
        done = attach_cuda(
            self._engine,
            kcfg,
            kv_caches,
            model=self._fingerprint,
            layout=resolved_layout(self._vllm_config, kcfg),
            backend=name,
            backend_cls=backend,
            cache_dtype=str(self._vllm_config.cache_config.cache_dtype),
            prefix_caching=bool(self._vllm_config.cache_config.enable_prefix_caching),
            wait_s=self._daemon_wait_s,
            on_release=self._on_release,
        )
        self._pull = PullLink(done.pool.peer_address, token=self._token)
        self.attached_bytes = done.described.spec.nbytes

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KvxferdMetadata):
            return
        for job in meta.pulls:
            with self._lock:
                if job.request_id in self._started:
                    continue
                self._started.add(job.request_id)
                self._load_errors.update(job.unfillable)
                if job.notify_only:
                    self._notify_only.add(job.request_id)
            if self._pull is None or not job.remote:
                why = (
                    "the KV cache is not attached to a daemon"
                    if self._pull is None
                    else "the ticket does not fit this engine's KV cache groups"
                )
                self._pull_done(
                    PullResult(job.request_id, "", "REFUSED", error=why, local=job.local),
                    job.request_id,
                )
                continue
            self._pull.start(
                f"vllm-{self._engine_id}-{job.request_id}",
                job.remote_request_id,
                job.peer_address,
                job.remote,
                job.local,
                deadline_ms=self._deadline_ms,
                on_done=functools.partial(self._pull_done, request_id=job.request_id),
            )

    def _pull_done(self, result: PullResult, request_id: str | None = None) -> None:
        rid = request_id or result.request_id
        with self._lock:
            if result.state != "DONE":
                failed = result.invalid_local or tuple(b for g in result.local for b in g)
                self._load_errors.update(failed)
                log.error(
                    "kvxferd: pulling the KV cache of request %s from %s ended %s; %d blocks"
                    " will follow vLLM's kv_load_failure_policy: %s",
                    rid,
                    result.transfer_id or "(not started)",
                    result.state,
                    len(failed),
                    result.error or "(no error detail)",
                )
            if rid in self._notify_only:
                self._notify_only.discard(rid)
                self._started.discard(rid)
            else:
                self._done_recv.add(rid)

    def _on_release(self, rel: Release) -> None:
        if rel.reason != "DONE":
            log.warning(
                "kvxferd: the daemon released held request %s (%s) before a reader finished;"
                " its blocks are freed",
                rel.request_id,
                rel.reason,
            )
        with self._lock:
            self._released.add(rel.request_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # pulls complete before vLLM schedules the request

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None  # the daemon reads vLLM's own pages: nothing to save

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            for rid in finished_req_ids:
                self._finished_seen[rid] = None
            while len(self._finished_seen) > _SEEN_MAX:
                self._finished_seen.popitem(last=False)
            sending = {r for r in self._released if r in self._finished_seen}
            self._released -= sending
            for r in sending:
                del self._finished_seen[r]
            recving = set(self._done_recv)
            self._done_recv.clear()
            self._started -= recving
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            out = set(self._load_errors)
            self._load_errors.clear()
        return out

    def shutdown(self) -> None:
        if self._pull is not None:
            self._pull.close()
        self._engine.close()
        self._alloc.unlink()

    # ---- scheduler side ----------------------------------------------------------------------

    def _ticket(self, request: Any) -> Ticket | None:
        try:
            return ticket_from_params(request.kv_transfer_params)
        except KvxferdError as err:
            log.error("kvxferd: request %s: %s; computing it locally", request.request_id, err)
            return None

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id in self._planned:
            return 0, False
        ticket = self._ticket(request)
        if ticket is None:
            return 0, False
        count = int(request.num_prompt_tokens) - int(num_computed_tokens)
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        if rid in self._planned:
            return
        ticket = self._ticket(request)
        if ticket is None:
            return
        self._planned.add(rid)
        tables = [
            [
                LocalBlock(
                    int(b.block_id),
                    num_external_tokens > 0 and not b.is_null and b.block_hash is None,
                )
                for b in blocks.blocks[g.vllm_group]
            ]
            for g in self._groups
        ]
        job, err = plan_pull(rid, ticket, tables, self._kinds, num_external_tokens)
        if err is not None:
            log.error("kvxferd: request %s: %s; computing it locally", rid, err)
        self._pending.append(job)

    def build_connector_meta(self, scheduler_output: Any) -> KvxferdMetadata:
        meta = KvxferdMetadata(self._pending)
        self._pending = []
        return meta

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        self._planned.discard(rid)
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None
        groups = [list(block_ids[g.vllm_group]) for g in self._groups]
        held = blocks_to_hold(
            self._kinds,
            groups,
            int(request.num_computed_tokens),
            [g.block_size for g in self._groups],
        )
        if not any(held.ids):
            return False, None
        try:
            resp = self._engine.hold(rid, held.ids, readers=1, ttl_ms=self._ttl_ms)
        except KvxferdError as err:
            log.error(
                "kvxferd: could not hold the KV cache of request %s for a decode engine (%s);"
                " the decode engine will compute the prompt itself",
                rid,
                err,
            )
            return False, {"do_remote_prefill": False, "do_remote_decode": False}
        ticket = Ticket(
            resp.peer_address,
            resp.request_id,
            held.ids,
            held.starts,
            int(resp.expires_unix_ns),
            int(request.num_computed_tokens),
        )
        return True, ticket.to_params()

    def take_events(self) -> Iterable[Any]:
        return ()
