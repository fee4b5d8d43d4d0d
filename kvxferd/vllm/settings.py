"""The connector's settings: vLLM's ``kv_transfer_config`` (its ``kv_connector_extra_config``)
and the parallel and model config it depends on, checked once at start. Pure: no vLLM import
(vLLM's config objects are read by attribute)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DOC = "docs/vllm.md"


def config_error(what: str, fix: str) -> ValueError:
    return ValueError(f"KvxferdConnector: {what}. Fix: {fix} (see {DOC})")


@dataclass(frozen=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` and vLLM's config say (docs/vllm.md)."""

    engine_socket: str
    token: str
    hold_ttl_ms: int
    pull_deadline_ms: int
    daemon_wait_s: float
    fingerprint: str
    engine_id: str

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> ConnectorSettings:
        """Raises ValueError (what is wrong, and the fix) for a config the connector cannot run."""
        cfg = vllm_config.kv_transfer_config
        extra: dict[str, Any] = dict(cfg.kv_connector_extra_config or {})
        socket = extra.get("engine_socket")
        if not isinstance(socket, str) or not socket:
            raise config_error(
                "kv_connector_extra_config has no 'engine_socket'",
                "set it to the Engine socket of the kvxferd daemon beside this engine"
                " (its server.engine_socket)",
            )
        par = vllm_config.parallel_config
        if par.tensor_parallel_size > 1 or par.pipeline_parallel_size > 1:
            raise config_error(
                f"tensor_parallel_size {par.tensor_parallel_size} and pipeline_parallel_size"
                f" {par.pipeline_parallel_size}: only one worker per engine is supported",
                "run TP 1 / PP 1 engines (one daemon each)",
            )
        token = ""
        if extra.get("token_file"):
            token = Path(str(extra["token_file"])).read_text().strip()
        model_cfg = vllm_config.model_config
        served = getattr(model_cfg, "served_model_name", None) or model_cfg.model
        if isinstance(served, (list, tuple)):
            served = served[0]
        return cls(
            engine_socket=socket,
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


__all__ = ["DOC", "ConnectorSettings", "attn_backend", "config_error"]
