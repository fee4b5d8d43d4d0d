"""The KV cache layout model: groups, regions, dtypes, layouts (pure values).

Owns: what a worker's KV cache looks like in memory, built from a TOML file (``tomlspec``),
live torch tensors (``tensors``) or a named preset (``presets``). Must not import nixl, grpc
or anything that does I/O beyond reading a spec file; torch is imported lazily, only by the
tensor helpers.
"""

from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.presets import PRESETS, preset
from kvxferd.layout.spec import GroupKind, KVCacheSpec, KVGroup, Layout, MemoryType, Region
from kvxferd.layout.tomlspec import dump_spec, load_spec, spec_from_dict

__all__ = [
    "PRESETS",
    "GroupKind",
    "KVCacheSpec",
    "KVDType",
    "KVGroup",
    "Layout",
    "MemoryType",
    "Region",
    "dump_spec",
    "load_spec",
    "preset",
    "spec_from_dict",
]
