"""Loading: the TOML file, then ``KVXFERD_*`` environment variables, then flag overrides,
each value converted to its field's type and the whole validated."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvxferd.config.sections import DOCS, SECTIONS, Config
from kvxferd.config.validate import validate
from kvxferd.errors import ConfigError

LIST_KEYS = frozenset({"peers.allow"})
"""String keys that also accept a TOML array of strings (joined with commas)."""

NON_CONFIG_ENV = frozenset(
    {
        "KVXFERD_TOOLS_CACHE",  # scripts/check_proto.sh: where pinned generators are installed
        "KVXFERD_NO_INSTALL",  # scripts/check_proto.sh: never install a missing tool
        "KVXFERD_FUZZ_SECONDS",  # tests/fuzz: how long the RPC fuzz suite runs
        "KVXFERD_FUZZ_REPORT",  # tests/fuzz: where the fuzz suite writes its JSON counts
    }
)
"""``KVXFERD_*`` variables that are not configuration keys and are never refused (tool and
test knobs; daemons started by a test run inherit them). Every other ``KVXFERD_*`` variable
must name a key (``KVXFERD_<SECTION>_<KEY>``). docs/config.md lists these too, and
tests/test_config.py checks that the repository uses no other."""


def documented_keys() -> list[str]:
    """Every ``section.key`` the configuration accepts."""
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def env_var(key: str) -> str:
    """The environment variable of ``section.key``: ``KVXFERD_SECTION_KEY``."""
    return "KVXFERD_" + key.replace(".", "_").upper()


def _env_overrides(environ: Mapping[str, str]) -> dict[str, str]:
    """``section.key -> value`` from ``KVXFERD_*`` variables; a variable that is neither a
    key nor in :data:`NON_CONFIG_ENV` is refused, naming the closest key."""
    by_var = {env_var(k): k for k in documented_keys()}
    out: dict[str, str] = {}
    for var in sorted(environ):
        if var in by_var:
            out[by_var[var]] = environ[var]
        elif var.upper().startswith("KVXFERD_") and var not in NON_CONFIG_ENV:
            close = difflib.get_close_matches(var.upper(), by_var, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]} ({by_var[close[0]]})? " if close else ""
            raise ConfigError(
                f"unknown environment variable {var}: no configuration key is named so",
                field=var,
                fix=f"{hint}rename or unset it; variables are KVXFERD_<SECTION>_<KEY> for the keys"
                f" in {DOCS}",
            )
    return out


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, str] | None = None,
) -> Config:
    """Merge file < environment < overrides, convert types and validate."""
    raw: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    if path:
        p = Path(path)
        data = read_config_file(p)
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(
                    f"key {section!r} in {p} is outside any [section]",
                    field=section,
                    fix=f"put it under its section ({', '.join(SECTIONS)}; keys in {DOCS})",
                )
            if section not in SECTIONS:
                raise ConfigError(
                    f"unknown section [{section}] in {p}",
                    field=section,
                    fix=f"sections are {', '.join(SECTIONS)}",
                )
            for k, v in table.items():
                raw[section][k] = v
    environ = os.environ if env is None else env
    for key, value in _env_overrides(environ).items():
        section, name = key.split(".")
        raw[section][name] = value
    for key, value in (overrides or {}).items():
        section, _, name = key.partition(".")
        if section not in SECTIONS or not name:
            close = difflib.get_close_matches(key, documented_keys(), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(
                f"unknown setting {key!r}",
                field=key,
                fix=f"{hint}use section.key with a key from {DOCS}",
            )
        raw[section][name] = value
    built = {s: _build(SECTIONS[s], s, raw[s]) for s in SECTIONS}
    cfg = Config(**built)
    validate(cfg)
    return cfg


def read_config_file(p: Path) -> dict[str, Any]:
    """The parsed ``--config`` file, or a :class:`ConfigError` saying why there is none."""
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {p} does not exist", fix="check --config") from exc
    except IsADirectoryError as exc:
        raise ConfigError(
            f"config file {p} is a directory", field="--config", fix="pass the TOML file's path"
        ) from exc
    except OSError as exc:
        raise ConfigError(
            f"cannot read config file {p}: {exc.strerror or exc}",
            field="--config",
            fix="check the path and its permissions",
        ) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {p} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset"
            f" {exc.start})",
            field="--config",
            fix="save it as UTF-8, as TOML requires",
        ) from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from exc


def _build(cls: type[Any], section: str, values: Mapping[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        if name not in fields:
            raise ConfigError(
                f"unknown key {name!r}",
                field=f"{section}.{name}",
                fix=f"keys of [{section}]: {', '.join(fields)}",
            )
        default = getattr(cls(), name)
        key = f"{section}.{name}"
        if key in LIST_KEYS and isinstance(value, list):
            if not all(isinstance(v, str) for v in value):
                raise ConfigError(
                    f"{value!r} must be a string or an array of strings",
                    field=key,
                    fix='write e.g. ["10.0.0.0/16", "prefill-0:50051"]',
                )
            kwargs[name] = ",".join(value)
            continue
        kwargs[name] = _convert(value, type(default), key)
    return cls(**kwargs)


def _convert(value: Any, typ: type, key: str) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{value!r} is not a boolean", field=key, fix="use true or false")
    if typ is int:
        # A float is refused even when integral (2.0), as "2.0" from --set or the environment
        # is: truncating 1.9 to 1 would silently change the setting.
        if isinstance(value, bool | float):
            raise ConfigError(
                f"{value!r} is not an integer", field=key, fix="write a whole number, e.g. 2"
            )
        try:
            return int(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"{value!r} is not an integer", field=key, fix="write a whole number, e.g. 2"
            ) from exc
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(f"{value!r} is not a number", field=key)
        try:
            number = float(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{value!r} is not a number", field=key) from exc
        if not math.isfinite(number):
            raise ConfigError(
                f"{value!r} is not a finite number", field=key, fix="write a finite number"
            )
        return number
    if not isinstance(value, str):
        raise ConfigError(f"{value!r} must be a string", field=key, fix="quote the value")
    return value


__all__ = ["LIST_KEYS", "NON_CONFIG_ENV", "documented_keys", "env_var", "load_config"]
