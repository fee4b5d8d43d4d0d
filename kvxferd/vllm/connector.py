"""``KvxferdConnector``: vLLM's KV connector (V1 API) backed by the kvxferd daemon beside it.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvxferdConnector",
      "kv_connector_module_path": "kvxferd.vllm.connector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"engine_socket": "/run/kvxferd/engine.sock"}}'

With tensor parallelism every worker rank has its own daemon: ``engine_socket`` holds
``{rank}`` (``/run/kvxferd/rank{rank}/engine.sock``) or lists one path per rank
(:mod:`kvxferd.vllm.settings`).

This is the only module of kvxferd that imports vLLM; vLLM imports it. What each side does:

* **worker** (one per TP rank, each with its own daemon): on the CPU backend
  ``get_mem_pool_context`` makes vLLM allocate its KV cache in shared memory
  (:mod:`kvxferd.vllm.memory`) and ``register_kv_caches`` translates the KV cache config into
  a kvxferd spec (:mod:`kvxferd.vllm.spec`) and attaches that memory to the rank's daemon at
  its TP position (IMPORTED host memory, :mod:`kvxferd.vllm.host`); on a GPU vLLM allocates
  its CUDA KV cache itself and ``register_kv_caches`` attaches it IMPORTED VRAM, served to
  same-host readers with KERNEL pulls (:mod:`kvxferd.vllm.gpu`); the engine session stays
  open. The rest is :class:`~kvxferd.vllm.worker.RankWorker`: ``start_load_kv`` starts this
  rank's pulls from the prefill daemon of the same rank; ``get_finished`` reports this rank's
  finished pulls and the prefills whose lease its daemon released (vLLM counts a request
  finished once every rank reported it); ``get_block_ids_with_load_errors`` reports the blocks
  of this rank's failed pulls (vLLM unions the ranks'), so ``kv_load_failure_policy``
  (recompute or fail) applies.
* **scheduler**: a finished prefill (``kv_transfer_params`` with ``do_remote_decode``) is held
  on every rank's daemon under a lease (:mod:`kvxferd.vllm.holds`) and its ticket, naming
  every rank's daemon, returned as the request's ``kv_transfer_params``
  (:mod:`kvxferd.vllm.params`); a decode request carrying a ticket reports the prompt's missing
  tokens as loadable and, once vLLM allocated its blocks, pairs them with the held ones
  position by position, so prefix-cache hits move only the missing blocks. A decode request
  that ends before its pull was planned (aborted), or whose pull cannot be planned, has its
  hold declined by every worker rank (``DeclinePull``), so the prefill engine gets its blocks
  back at once rather than at the lease's TTL.

Configuration (``kv_connector_extra_config``), errors and limits: docs/vllm.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger

from kvxferd.errors import KvxferdError
from kvxferd.vllm.daemon import EngineLink
from kvxferd.vllm.gpu import attach_cuda
from kvxferd.vllm.holds import RankHolds
from kvxferd.vllm.host import attach_shared
from kvxferd.vllm.kinds import resolved_layout
from kvxferd.vllm.memory import SharedKvAllocation
from kvxferd.vllm.params import (
    Decline,
    LocalBlock,
    PullJob,
    Ticket,
    blocks_to_hold,
    check_prompt,
    plan_pull,
    ticket_from_params,
    unpulled_decline,
)
from kvxferd.vllm.pull_link import PullLink
from kvxferd.vllm.settings import ConnectorSettings, attn_backend
from kvxferd.vllm.spec import transfer_groups
from kvxferd.vllm.worker import RankWorker

# A child of the "vllm" logger: our lines go through vLLM's handler, format and level.
log = init_logger("vllm.kvxferd")


@dataclass
class KvxferdMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> every worker rank, once per step: the pulls to start, the finished prefills
    whose blocks vLLM keeps until every rank reported them sent (``delayed``: only these may
    be reported), per such prefill the TP ranks that could not hold it (they report it sent at
    once), and the held prefills this engine will not pull (each rank declines its own)."""

    pulls: list[PullJob] = field(default_factory=list)
    unheld: dict[str, tuple[int, ...]] = field(default_factory=dict)
    declines: list[Decline] = field(default_factory=list)
    delayed: list[str] = field(default_factory=list)


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class KvxferdConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM KV connector that moves KV blocks through kvxferd daemons (see the module doc)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.from_vllm_config(vllm_config)
        self._tp_size = settings.tp_size
        self._daemon_wait_s = settings.daemon_wait_s
        self._fingerprint = settings.fingerprint
        self._groups = transfer_groups(kv_cache_config)
        self._kinds = [g.kind for g in self._groups]
        self._token = settings.token
        # scheduler side
        self._holds: RankHolds | None = None
        self._pending: list[PullJob] = []
        self._unheld: dict[str, tuple[int, ...]] = {}
        self._declines: list[Decline] = []
        self._delayed: list[str] = []
        self._planned: set[str] = set()
        # worker side
        self._engine: EngineLink | None = None
        self._alloc = SharedKvAllocation()
        rank = 0
        if role == KVConnectorRole.SCHEDULER:
            self._holds = RankHolds(
                settings.engine_sockets, token=settings.token, ttl_ms=settings.hold_ttl_ms
            )
        else:
            rank = _tp_rank() if self._tp_size > 1 else 0
            self._engine = EngineLink(settings.engine_socket(rank), token=settings.token)
        self._worker = RankWorker(settings.engine_id, rank, deadline_ms=settings.pull_deadline_ms)
        self.attached_bytes = 0

    # ---- worker side -------------------------------------------------------------------------

    def get_mem_pool_context(self) -> Any:
        from vllm.platforms import current_platform

        return self._alloc if current_platform.is_cpu() else None

    def _attach_args(self, kv_caches: dict[str, Any]) -> dict[str, Any]:
        cache = self._vllm_config.cache_config
        return {
            "model": self._fingerprint,
            "layout": resolved_layout(self._vllm_config, self._kv_cache_config),
            "cache_dtype": str(cache.cache_dtype),
            "tp_rank": self._worker.tp_rank,
            "tp_size": self._tp_size,
            "prefix_caching": bool(cache.enable_prefix_caching),
            "wait_s": self._daemon_wait_s,
            "on_release": self._worker.on_release,
        }

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.platforms import current_platform

        assert self._engine is not None, "register_kv_caches runs on the worker side"
        backend, name = attn_backend(self._vllm_config, kv_caches)
        if current_platform.is_cpu():
            host = attach_shared(
                self._engine,
                self._alloc,
                self._kv_cache_config,
                kv_caches,
                backend=name,
                **self._attach_args(kv_caches),
            )
            pool, nbytes = host.pool, host.translated.spec.nbytes
        else:  # vLLM's own CUDA KV cache, attached IMPORTED VRAM (kvxferd.vllm.gpu)
            done = attach_cuda(
                self._engine,
                self._kv_cache_config,
                kv_caches,
                backend=name,
                backend_cls=backend,
                **self._attach_args(kv_caches),
            )
            pool, nbytes = done.pool, done.described.spec.nbytes
        self._worker.pull = PullLink(
            pool.peer_address, token=self._token, socket=pool.scheduler_socket
        )
        self.attached_bytes = nbytes

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KvxferdMetadata):
            return
        rank = self._worker.tp_rank
        self._worker.await_release(meta.delayed)  # before any report: only these are reported
        self._worker.release_unheld(r for r, ranks in meta.unheld.items() if rank in ranks)
        self._worker.decline(meta.declines)
        self._worker.start(meta.pulls)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # pulls complete before vLLM schedules the request

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None  # the daemon reads vLLM's own pages: nothing to save

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._worker.finished(finished_req_ids)
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    def shutdown(self) -> None:
        self._worker.close()
        if self._engine is not None:
            self._engine.close()
        if self._holds is not None:
            self._holds.close()
        self._alloc.unlink()

    # ---- scheduler side ----------------------------------------------------------------------

    def _ticket(self, request: Any) -> Ticket | None:
        try:
            ticket = ticket_from_params(request.kv_transfer_params)
            if ticket is not None:
                check_prompt(ticket, int(request.num_prompt_tokens))
            return ticket
        except KvxferdError as err:  # not planned: request_finished declines its hold
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
        job, err = plan_pull(
            rid, ticket, tables, self._kinds, num_external_tokens, tp_size=self._tp_size
        )
        if err is not None:
            log.error("kvxferd: request %s: %s; computing it locally", rid, err)
            self._declines.append(Decline.of(ticket, self._tp_size))  # nothing reads its hold
        self._pending.append(job)

    def build_connector_meta(self, scheduler_output: Any) -> KvxferdMetadata:
        meta = KvxferdMetadata(self._pending, self._unheld, self._declines, self._delayed)
        self._pending, self._unheld, self._declines, self._delayed = [], {}, [], []
        return meta

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = self._finished(request, block_ids)
        if delay:  # the workers report it sent (vLLM asserts it still exists): only these
            self._delayed.append(request.request_id)
        return delay, params

    def _finished(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        planned = rid in self._planned
        self._planned.discard(rid)
        params = request.kv_transfer_params
        decline = unpulled_decline(
            params, planned=planned, now_ns=time.time_ns(), decode_tp=self._tp_size
        )
        if decline is not None:  # aborted before its pull: the prefill holds it for nobody
            self._declines.append(decline)
        if not params or not params.get("do_remote_decode") or self._holds is None:
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None
        groups = [list(block_ids[g.vllm_group]) for g in self._groups]
        num_tokens = int(request.num_computed_tokens)
        held = blocks_to_hold(self._kinds, groups, num_tokens, [g.block_size for g in self._groups])
        if not any(held.ids):
            return False, None
        out = self._holds.hold(rid, held, num_tokens)
        if out.ticket is not None:
            return True, out.ticket.to_params()
        log.error(
            "kvxferd: could not hold the KV cache of request %s on every TP rank's daemon (%s);"
            " the decode engine will compute the prompt itself",
            rid,
            "; ".join(out.errors),
        )
        no_remote = {"do_remote_prefill": False, "do_remote_decode": False}
        if not out.held:
            return False, no_remote
        # Some ranks hold it until their lease lapses; vLLM frees the blocks once every rank
        # reported the request sent, the others at once (KvxferdMetadata.unheld).
        self._unheld[rid] = out.unheld
        return True, no_remote

    def take_events(self) -> Iterable[Any]:
        return ()
