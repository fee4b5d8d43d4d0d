"""One validated configuration: TOML file, then ``KVXFERD_*`` environment, then flags.

Every key has its default and meaning next to its field; ``docs/config.md`` is the reference
(a test checks the two agree). Environment variables are read here and nowhere else:
``KVXFERD_<SECTION>_<KEY>`` (e.g. ``KVXFERD_SERVER_LISTEN``, ``KVXFERD_AUTH_TOKEN``); any
other ``KVXFERD_*`` variable is refused (naming the closest key) unless it is one of
:data:`NON_CONFIG_ENV`. Flags arrive as ``section.key=value`` overrides. Errors name the key and
say how to fix it.

The package: :mod:`~kvxferd.config.sections` (the keys), :mod:`~kvxferd.config.load` (file,
environment, flags), :mod:`~kvxferd.config.validate` (checks across keys) and
:mod:`~kvxferd.config.addresses`.
"""

from __future__ import annotations

from kvxferd.config.addresses import is_loopback, split_hostport
from kvxferd.config.load import (
    LIST_KEYS,
    NON_CONFIG_ENV,
    documented_keys,
    env_var,
    load_config,
)
from kvxferd.config.sections import (
    DOCS,
    SECTIONS,
    AuthConfig,
    Config,
    LogConfig,
    NixlConfig,
    PeersConfig,
    PoolConfig,
    ServerConfig,
    TransferConfig,
)
from kvxferd.config.validate import validate

__all__ = [
    "DOCS",
    "LIST_KEYS",
    "NON_CONFIG_ENV",
    "SECTIONS",
    "AuthConfig",
    "Config",
    "LogConfig",
    "NixlConfig",
    "PeersConfig",
    "PoolConfig",
    "ServerConfig",
    "TransferConfig",
    "documented_keys",
    "env_var",
    "is_loopback",
    "load_config",
    "split_hostport",
    "validate",
]
