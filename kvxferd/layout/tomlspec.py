"""Read and write KV cache specs as TOML (format documented in ``docs/spec.md``)."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvxferd.errors import SpecError
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import GroupKind, KVCacheSpec, KVGroup, Layout, MemoryType, Region

_GROUP_KEYS = {"name", "kind", "logical_block_size", "kernel_block_size"}
_REGION_KEYS = {"name", "group", "dtype", "layout", "shape", "memory", "block_stride", "repeat"}


def load_spec(path: str | Path) -> KVCacheSpec:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise SpecError(
            f"spec file {p} does not exist", fix="pass the path of a TOML spec"
        ) from exc
    except IsADirectoryError as exc:
        raise SpecError(
            f"spec file {p} is a directory", fix="pass the path of a TOML spec file"
        ) from exc
    except OSError as exc:
        raise SpecError(
            f"cannot read spec file {p}: {exc.strerror or exc}", fix="check its permissions"
        ) from exc
    except UnicodeDecodeError as exc:
        raise SpecError(f"spec file {p} is not UTF-8 text", fix="save it as UTF-8") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"spec file {p} is not valid TOML: {exc}", fix="fix the syntax") from exc
    return spec_from_dict(data, source=str(p))


def spec_from_dict(data: Mapping[str, Any], *, source: str = "spec") -> KVCacheSpec:
    """Build a spec from parsed TOML. ``repeat = N`` with ``{i}`` in a name makes N regions."""
    unknown = set(data) - {"model", "groups", "regions"}
    if unknown:
        raise SpecError(
            f"{source}: unknown top-level keys {sorted(unknown)}",
            fix="allowed: model, [[groups]], [[regions]]",
        )
    groups_raw = _list_of_tables(data.get("groups"), f"{source}: groups")
    groups: list[KVGroup] = []
    for i, g in enumerate(groups_raw):
        where = f"groups[{i}]"
        _no_unknown(g, _GROUP_KEYS, where)
        try:
            kind = GroupKind(_req(g, "kind", where))
        except ValueError as exc:
            kinds = ", ".join(k.value for k in GroupKind)
            raise SpecError(
                f"unknown kind {g['kind']!r}", field=f"{where}.kind", fix=f"use {kinds}"
            ) from exc
        lbs = _int(g, "logical_block_size", where)
        kbs = _int(g, "kernel_block_size", where) if "kernel_block_size" in g else lbs
        groups.append(KVGroup(str(_req(g, "name", where)), kind, lbs, kbs))
    names = {g.name: i for i, g in enumerate(groups)}
    regions: list[Region] = []
    for i, r in enumerate(_list_of_tables(data.get("regions"), f"{source}: regions")):
        where = f"regions[{i}]"
        _no_unknown(r, _REGION_KEYS, where)
        gname = str(_req(r, "group", where))
        if gname not in names:
            raise SpecError(
                f"names group {gname!r}, which is not declared",
                field=f"{where}.group",
                fix=f"use one of {sorted(names)}",
            )
        try:
            dtype = KVDType.parse(str(_req(r, "dtype", where)))
            layout = Layout(str(_req(r, "layout", where)).upper())
            memory = MemoryType(str(r.get("memory", "DRAM")).upper())
        except ValueError as exc:
            raise SpecError(
                str(exc), field=where, fix="see docs/spec.md for allowed values"
            ) from exc
        shape_raw = _req(r, "shape", where)
        if not isinstance(shape_raw, list) or not all(_is_int(d) for d in shape_raw):
            raise SpecError(
                f"shape must be a list of integers, got {shape_raw!r}",
                field=f"{where}.shape",
                fix="write the region tensor's shape, e.g. shape = [600, 2, 16, 8, 128]",
            )
        repeat = _int(r, "repeat", where) if "repeat" in r else 1
        base_name = str(_req(r, "name", where))
        if repeat > 1 and "{i}" not in base_name:
            raise SpecError(
                f"repeat = {repeat} but the name {base_name!r} has no {{i}}",
                field=f"{where}.name",
                fix='write the name as e.g. "layer.{i}"',
            )
        for k in range(repeat):
            regions.append(
                Region(
                    name=base_name.replace("{i}", str(k)),
                    group=names[gname],
                    dtype=dtype,
                    layout=layout,
                    shape=tuple(shape_raw),
                    memory=memory,
                    block_stride=_int(r, "block_stride", where) if "block_stride" in r else 0,
                )
            )
    return KVCacheSpec(str(data.get("model", "")), tuple(groups), tuple(regions))


def dump_spec(spec: KVCacheSpec) -> str:
    """TOML text for a spec, one ``[[regions]]`` table per region (no ``repeat`` folding)."""
    d = spec.to_dict()
    out = [f"model = {_q(d['model'])}", ""]
    for g in d["groups"]:
        out += ["[[groups]]"] + [f"{k} = {_v(v)}" for k, v in g.items()] + [""]
    for r in d["regions"]:
        out += ["[[regions]]"] + [f"{k} = {_v(v)}" for k, v in r.items()] + [""]
    return "\n".join(out)


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _v(v: object) -> str:
    if isinstance(v, str):
        return _q(v)
    if isinstance(v, list):
        return "[" + ", ".join(_v(x) for x in v) + "]"
    return str(v)


def _list_of_tables(v: object, where: str) -> list[Mapping[str, Any]]:
    if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
        raise SpecError(f"{where} must be an array of tables", fix="write [[groups]] / [[regions]]")
    return v


def _no_unknown(t: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = set(t) - allowed
    if extra:
        raise SpecError(
            f"unknown keys {sorted(extra)}", field=where, fix=f"allowed keys: {sorted(allowed)}"
        )


def _req(t: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in t:
        raise SpecError(f"missing key {key!r}", field=where, fix=f"add {key} = ...")
    return t[key]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(t: Mapping[str, Any], key: str, where: str) -> int:
    v = _req(t, key, where)
    if not _is_int(v):
        raise SpecError(
            f"{key} must be an integer, got {v!r}",
            field=f"{where}.{key}",
            fix=f"write {key} as a whole number without quotes (docs/spec.md)",
        )
    return int(v)
