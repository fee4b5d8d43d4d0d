"""Named model-shaped specs for demos, benchmarks and tests.

A preset is named, optionally with overrides: ``"hybrid:ppl=34,num_blocks=64"``. Every preset
takes ``num_blocks`` (logical blocks per group, which sets the pool size) and ``memory``; the
others take what their family varies (see each builder's keyword arguments).

========  ==========================================================================
name      shaped like
========  ==========================================================================
dense     Llama-3-8B: 32 layers, 8 KV heads x 128, bf16, 16-token blocks (64 KiB per
          block per layer). ``layout=HND`` or ``cross_layer=1`` change the layout.
hybrid    Nemotron-H / Qwen3.5-like attention + Mamba: 4 attention layers with large
          ``ppl`` (kernel block 16, default ppl 66) and 12 Mamba layers whose conv and
          SSM states are one block each (state dims scaled down to stay demo-sized).
mla       DeepSeek-V3-like MLA: 61 layers of a 576-wide latent (512 + 64 rope), bf16,
          64-token blocks, replicated across TP.
fp8       An fp8 (e4m3) KV model with bf16 skip layers: 24 full-attention layers in fp8
          and 8 sliding-window layers kept in bf16, two KV cache groups.
========  ==========================================================================
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

from kvxferd.errors import SpecError
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import GroupKind, KVCacheSpec, KVGroup, Layout, MemoryType, Region

Builder = Callable[..., KVCacheSpec]


def dense(
    *,
    num_blocks: int = 512,
    num_layers: int = 32,
    num_kv_heads: int = 8,
    head_size: int = 128,
    block_size: int = 16,
    layout: str = "NHD",
    cross_layer: bool = False,
    dtype: str = "bf16",
    memory: str = "DRAM",
) -> KVCacheSpec:
    mem = MemoryType(memory.upper())
    group = KVGroup("full", GroupKind.FULL_ATTENTION, block_size, block_size)
    lay = Layout(layout.upper())
    dt = KVDType.parse(dtype)
    inner = (2, block_size, num_kv_heads, head_size)
    if cross_layer:
        xl = Layout.CROSS_LAYER_HND if lay is Layout.HND else Layout.CROSS_LAYER_NHD
        regions: tuple[Region, ...] = (
            Region("layers", 0, dt, xl, (num_layers, num_blocks, *inner), mem),
        )
    else:
        regions = tuple(
            Region(f"layer.{i}", 0, dt, lay, (num_blocks, *inner), mem) for i in range(num_layers)
        )
    return KVCacheSpec("llama-3-8b", (group,), regions)


def hybrid(
    *,
    num_blocks: int = 16,
    ppl: int = 66,
    kernel_block_size: int = 16,
    attention_layers: int = 4,
    mamba_layers: int = 12,
    num_kv_heads: int = 2,
    head_size: int = 128,
    layout: str = "HND",
    memory: str = "DRAM",
) -> KVCacheSpec:
    mem = MemoryType(memory.upper())
    logical = kernel_block_size * ppl
    groups = (
        KVGroup("attention", GroupKind.FULL_ATTENTION, logical, kernel_block_size),
        KVGroup("mamba", GroupKind.MAMBA, logical, logical),
    )
    lay = Layout(layout.upper())
    regions: list[Region] = [
        Region(
            f"attn.{i}",
            0,
            KVDType.BF16,
            lay,
            (num_blocks * ppl, 2, kernel_block_size, num_kv_heads, head_size),
            mem,
        )
        for i in range(attention_layers)
    ]
    for i in range(mamba_layers):
        regions.append(
            Region(f"mamba.{i}.conv", 1, KVDType.BF16, Layout.STATE, (num_blocks, 3, 1024), mem)
        )
        regions.append(
            Region(f"mamba.{i}.ssm", 1, KVDType.FP32, Layout.STATE, (num_blocks, 8, 64, 16), mem)
        )
    return KVCacheSpec("nemotron-h-like", groups, tuple(regions))


def mla(
    *,
    num_blocks: int = 128,
    num_layers: int = 61,
    latent_dim: int = 576,
    block_size: int = 64,
    memory: str = "DRAM",
) -> KVCacheSpec:
    mem = MemoryType(memory.upper())
    group = KVGroup("mla", GroupKind.MLA, block_size, block_size)
    regions = tuple(
        Region(f"layer.{i}", 0, KVDType.BF16, Layout.MLA, (num_blocks, block_size, latent_dim), mem)
        for i in range(num_layers)
    )
    return KVCacheSpec("deepseek-v3-like", (group,), regions)


def fp8(
    *,
    num_blocks: int = 512,
    full_layers: int = 24,
    sliding_layers: int = 8,
    num_kv_heads: int = 8,
    head_size: int = 128,
    block_size: int = 16,
    memory: str = "DRAM",
) -> KVCacheSpec:
    mem = MemoryType(memory.upper())
    groups = (
        KVGroup("full", GroupKind.FULL_ATTENTION, block_size, block_size),
        KVGroup("sliding", GroupKind.SLIDING_WINDOW, block_size, block_size),
    )
    shape = (num_blocks, 2, block_size, num_kv_heads, head_size)
    total = full_layers + sliding_layers
    every = max(1, total // max(1, sliding_layers))
    regions = []
    n_sliding = 0
    for i in range(total):
        is_sliding = n_sliding < sliding_layers and i % every == every - 1
        n_sliding += is_sliding
        if is_sliding:
            regions.append(Region(f"layer.{i}", 1, KVDType.BF16, Layout.NHD, shape, mem))
        else:
            regions.append(Region(f"layer.{i}", 0, KVDType.FP8_E4M3, Layout.NHD, shape, mem))
    return KVCacheSpec("fp8-skip-bf16", groups, tuple(regions))


PRESETS: Mapping[str, Builder] = {"dense": dense, "hybrid": hybrid, "mla": mla, "fp8": fp8}


# Layers a preset may have: real models have a few hundred at most, and building a preset costs
# time and memory per layer (an Attach of 10^8 layers once held the daemon's loop for minutes).
MAX_PRESET_LAYERS = 4096


def preset(text: str, **overrides: object) -> KVCacheSpec:
    """Build a preset from ``"name"`` or ``"name:key=value,key=value"`` plus keyword overrides."""
    name, _, opts = text.partition(":")
    builder = PRESETS.get(name.strip())
    if builder is None:
        raise SpecError(
            f"unknown preset {name!r}",
            field="preset",
            fix=f"use one of {', '.join(PRESETS)} (optionally name:key=value,...)",
        )
    options = {
        p.name: p.default
        for p in inspect.signature(builder).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    kwargs: dict[str, object] = {}
    for item in filter(None, (o.strip() for o in opts.split(","))):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq:
            raise SpecError(
                f"preset option {item!r} has no value", field="preset", fix="write key=value"
            )
        if key not in options:
            raise SpecError(
                f"preset {name!r} does not take option {key!r}",
                field=f"preset.{key}",
                fix=f"its options: {', '.join(options)}",
            )
        kwargs[key] = _parse_value(name, key, value, options[key])
    kwargs.update(overrides)
    for key, count in kwargs.items():  # refused before anything is built (one region a layer)
        if key.endswith("layers") and isinstance(count, int) and count > MAX_PRESET_LAYERS:
            raise SpecError(
                f"preset {name!r}: {key} = {count} is more than {MAX_PRESET_LAYERS} layers",
                field=f"preset.{key}",
                fix=f"give the model's real layer count (at most {MAX_PRESET_LAYERS})",
            )
    try:
        return builder(**kwargs)
    except TypeError as exc:
        raise SpecError(
            f"preset {name!r} does not take these options: {exc}",
            field="preset",
            fix=f"see kvxferd.layout.presets.{builder.__name__} for its options",
        ) from exc
    except ValueError as exc:
        raise SpecError(f"preset {name!r}: {exc}", field="preset") from exc


def _parse_value(name: str, key: str, text: str, default: object) -> object:
    """``text`` as the type of the option's default, or a :class:`SpecError` naming it."""
    low = text.lower()
    if isinstance(default, bool):
        if low in ("true", "yes", "on", "1"):
            return True
        if low in ("false", "no", "off", "0"):
            return False
        raise SpecError(
            f"preset {name!r}: {key} = {text!r} is not a boolean",
            field=f"preset.{key}",
            fix=f"write {key}=true or {key}=false",
        )
    if isinstance(default, int):
        try:
            number = int(text)
        except ValueError:
            number = -1
            least = "an integer"
        else:
            least = "an integer >= 1" if key == "num_blocks" else "an integer >= 0"
        if number < (key == "num_blocks"):
            raise SpecError(
                f"preset {name!r}: {key} = {text!r} is not {least}",
                field=f"preset.{key}",
                fix=f"write e.g. {key}={default}",
            )
        return number
    return text
