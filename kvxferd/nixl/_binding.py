"""Where the ``nixl`` Python package is imported: the one place in kvxferd.

The ``nixl`` shim picks ``nixl_cu13``/``nixl_cu12`` from the CUDA it detects; when the shim is
missing or fails (no CUDA stack, only one wheel installed) the wheels are imported directly.
Everything else in kvxferd reaches NIXL through :mod:`kvxferd.nixl.agent`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from kvxferd.errors import ConfigError
from kvxferd.logs import adopt

_CANDIDATES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


def _load() -> tuple[Any, ModuleType]:
    errors: list[str] = []
    for name in _CANDIDATES:
        try:
            api = importlib.import_module(name)
        except ImportError as exc:  # the shim raises ImportError when it finds no backend
            errors.append(f"{name}: {exc}")
            continue
        bindings = api.nixlBind
        return api, bindings
    raise ConfigError(
        "cannot import NIXL (" + "; ".join(errors) + ")",
        fix="install the daemon's extra: pip install 'kvxferd[cu13]' (CUDA 13) or"
        " 'kvxferd[cu12]' (CUDA 12), not both",
    )


api, bindings = _load()
# NIXL's Python logger configured itself (a stdout handler) on import: route it into
# kvxferd's stream (a no-op unless `kvxferd serve` set up logging).
adopt("nixl")

nixl_agent: Any = api.nixl_agent
nixl_agent_config: Any = api.nixl_agent_config
