"""The connector's settings: vLLM's ``kv_transfer_config`` (its ``kv_connector_extra_config``)
and the parallel and model config it depends on, checked once at start. Pure: no vLLM import
(vLLM's config objects are read by attribute).

Tensor parallelism: one kvxferd daemon per worker rank. ``engine_socket`` is either one path
containing ``{rank}`` (formatted with each TP rank: ``/run/kvxferd/rank{rank}/engine.sock``) or
a list with one path per rank, in rank order; a single path without ``{rank}`` serves TP 1
only. Worker rank ``r`` attaches its KV cache to ``engine_sockets[r]``; the scheduler side
holds a finished prefill on every rank's daemon (docs/vllm.md, "Tensor parallelism").
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DOC = "docs/vllm.md"
RANK = "{rank}"


def config_error(what: str, fix: str) -> ValueError:
    return ValueError(f"KvxferdConnector: {what}. Fix: {fix} (see {DOC})")


def _refuse_parallelism(par: Any) -> None:
    """Refuse the parallel layouts the connector does not move KV for, with the reason."""
    pp = int(getattr(par, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        raise config_error(
            f"pipeline_parallel_size {pp}: pipeline parallelism splits the layers over"
            " workers, and a kvxferd ticket names whole-model blocks of one daemon per TP rank,"
            " with no notion of a layer range per stage",
            "run prefill and decode engines with pipeline_parallel_size 1 (tensor parallelism"
            " is supported)",
        )
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(par, name, 1) or 1)
        if size > 1:
            raise config_error(
                f"{name} {size}: context parallelism shards each request's tokens over"
                " workers, so a rank's blocks hold only some of the prompt's positions",
                f"run with {name} 1",
            )
    nodes = int(getattr(par, "nnodes", 1) or 1)
    if nodes > 1:
        raise config_error(
            f"nnodes {nodes}: the scheduler holds a finished prefill on every TP rank's daemon"
            " through its Unix socket, which only the ranks on the scheduler's host have",
            "keep each engine's TP ranks on one host (one daemon per rank beside it)",
        )


def engine_sockets(raw: Any, tp_size: int) -> tuple[str, ...]:
    """One Engine socket path per TP rank, from ``engine_socket`` (a path, a path containing
    ``{rank}``, or a list of paths in rank order). Raises ValueError with the fix."""
    if isinstance(raw, (list, tuple)):
        paths = list(raw)
        if not paths or not all(isinstance(p, str) and p for p in paths):
            raise config_error(
                f"kv_connector_extra_config's 'engine_socket' list {paths!r} must hold"
                " non-empty paths",
                "list one Engine socket path per TP rank, rank 0 first",
            )
        if len(paths) != tp_size:
            raise config_error(
                f"kv_connector_extra_config's 'engine_socket' lists {len(paths)} paths for"
                f" tensor_parallel_size {tp_size}",
                f"list exactly {tp_size} Engine socket paths, one per TP rank (rank 0 first),"
                f" or give one path containing {RANK}",
            )
        if len(set(paths)) != len(paths):
            raise config_error(
                f"kv_connector_extra_config's 'engine_socket' list {paths!r} names a path twice",
                "give every TP rank its own daemon (one Engine socket each)",
            )
        return tuple(paths)
    if not isinstance(raw, str) or not raw:
        raise config_error(
            "kv_connector_extra_config has no 'engine_socket'",
            "set it to the Engine socket of the kvxferd daemon beside this engine"
            f" (its server.engine_socket); with tensor parallelism, a path containing {RANK}"
            " or a list of one path per rank",
        )
    if RANK in raw:
        try:
            return tuple(raw.format(rank=r) for r in range(tp_size))
        except (KeyError, IndexError, ValueError) as exc:
            raise config_error(
                f"kv_connector_extra_config's 'engine_socket' {raw!r} is not a path template"
                f" whose only field is {RANK} ({exc!r})",
                f"use {RANK} as the only brace field (e.g. /run/kvxferd/rank{RANK}/engine.sock)",
            ) from None
    if tp_size > 1:
        raise config_error(
            f"tensor_parallel_size {tp_size} with one 'engine_socket' {raw!r}: every TP rank"
            " needs its own kvxferd daemon (a daemon serves one rank's KV cache)",
            f"run one daemon per rank and put {RANK} in the path"
            f" (e.g. /run/kvxferd/rank{RANK}/engine.sock), or list one path per rank",
        )
    return (raw,)


@dataclass(frozen=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` and vLLM's config say (docs/vllm.md)."""

    engine_sockets: tuple[str, ...]  # one per TP rank, rank order
    token: str
    hold_ttl_ms: int
    pull_deadline_ms: int
    daemon_wait_s: float
    fingerprint: str
    engine_id: str

    @property
    def tp_size(self) -> int:
        return len(self.engine_sockets)

    def engine_socket(self, rank: int) -> str:
        """The Engine socket of TP rank ``rank``'s daemon."""
        if not 0 <= rank < self.tp_size:
            raise config_error(
                f"TP rank {rank} is outside the {self.tp_size} engine sockets configured",
                "list one Engine socket per TP rank",
            )
        return self.engine_sockets[rank]

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> ConnectorSettings:
        """Raises ValueError (what is wrong, and the fix) for a config the connector cannot run."""
        cfg = vllm_config.kv_transfer_config
        extra: dict[str, Any] = dict(cfg.kv_connector_extra_config or {})
        par = vllm_config.parallel_config
        _refuse_parallelism(par)
        sockets = engine_sockets(extra.get("engine_socket"), int(par.tensor_parallel_size))
        token = ""
        if extra.get("token_file"):
            token = Path(str(extra["token_file"])).read_text().strip()
        model_cfg = vllm_config.model_config
        served = getattr(model_cfg, "served_model_name", None) or model_cfg.model
        if isinstance(served, (list, tuple)):
            served = served[0]
        return cls(
            engine_sockets=sockets,
            token=token,
            hold_ttl_ms=int(extra.get("hold_ttl_ms", 0)),
            pull_deadline_ms=int(extra.get("pull_deadline_ms", 0)),
            daemon_wait_s=float(extra.get("daemon_wait_s", 60.0)),
            fingerprint=str(extra.get("model_fingerprint") or served),
            engine_id=str(getattr(cfg, "engine_id", None) or uuid.uuid4().hex[:12]),
        )


def attn_backend(vllm_config: Any, layer_names: Any) -> tuple[Any, str]:
    """The attention backend (class) of the first of ``layer_names`` that has one in vLLM's
    forward context, and its name; ``(None, "")`` if none does."""
    ctx = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    for name in layer_names:
        backend = getattr(ctx.get(name), "attn_backend", None)
        if backend is not None:
            try:
                return backend, str(backend.get_name())
            except Exception:  # a backend without a name
                return backend, type(backend).__name__
    return None, ""


__all__ = ["DOC", "ConnectorSettings", "attn_backend", "config_error", "engine_sockets"]
