"""Creating the NIXL binding's agent: its config, and the progress thread's delay.

``nixl_agent.__init__`` hard-codes ``pthrDelay = 0`` (a busy-spinning progress thread). The
raw binding's config has the field; the wrapper's module-level ``nixlBind`` is swapped for a
proxy only while one agent is constructed, under a lock, so the proxy can set the delay.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from kvxferd.errors import TransportError
from kvxferd.nixl._binding import api, nixl_agent, nixl_agent_config
from kvxferd.nixl.errors import map_nixl_error
from kvxferd.nixl.types import ProgressMode

_CONSTRUCT_LOCK = threading.Lock()


class _DelayedBindings:
    def __init__(self, real: Any, delay_us: int) -> None:
        self._real = real
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 (NIXL's spelling)
        config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)


@dataclass(frozen=True)
class AgentOptions:
    """How the agent is built. Defaults are kvxferd's choice (see the package docstring)."""

    progress: ProgressMode = ProgressMode.THREAD
    progress_delay_us: int = 100
    capture_telemetry: bool = True
    num_threads: int = 0
    backends: tuple[str, ...] = ("UCX",)
    idle_poll_s: float = 0.005


def create_binding_agent(name: str, opts: AgentOptions) -> Any:
    """The NIXL binding's agent named ``name``, built as ``opts`` says (call on the NIXL
    thread). Raises TransportError when none of the backends could be created."""
    config = nixl_agent_config(
        enable_prog_thread=opts.progress is ProgressMode.THREAD,
        capture_telemetry=opts.capture_telemetry,
        num_threads=opts.num_threads,
        backends=list(opts.backends),
    )
    try:
        if opts.progress is ProgressMode.THREAD:
            with _CONSTRUCT_LOCK:
                real = api.nixlBind
                api.nixlBind = _DelayedBindings(real, opts.progress_delay_us)
                try:
                    agent = nixl_agent(name, config)
                finally:
                    api.nixlBind = real
        else:
            agent = nixl_agent(name, config)
    except Exception as exc:
        raise map_nixl_error(exc, op="create agent") from exc
    if not agent.backends:
        raise TransportError(
            f"agent {name}: none of the backends {opts.backends} could be created",
            fix="check that the NIXL wheel ships the UCX plugin (NIXL_PLUGIN_DIR)",
        )
    return agent


__all__ = ["AgentOptions", "create_binding_agent"]
