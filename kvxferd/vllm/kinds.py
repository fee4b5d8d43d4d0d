"""Reading vLLM's KV cache spec objects: by class name and attribute, never by importing vLLM.

Which spec classes kvxferd can move (and which subclasses it refuses, and why), the page
layouts it understands, and the KV dtypes it carries. Pure; tests pass stand-ins.
"""

from __future__ import annotations

from typing import Any

from kvxferd.errors import SpecError
from kvxferd.layout.dtypes import KVDType
from kvxferd.layout.spec import GroupKind, Layout

DOC = "docs/vllm.md"

# vLLM spec classes kvxferd can move, by class name (read off the MRO, most specific first).
_KINDS: dict[str, GroupKind] = {
    "FullAttentionSpec": GroupKind.FULL_ATTENTION,
    "SlidingWindowSpec": GroupKind.SLIDING_WINDOW,
    "MLAAttentionSpec": GroupKind.MLA,
    "MambaSpec": GroupKind.MAMBA,
}
# Subclasses whose pages or block semantics differ from their base: refused by name.
_REFUSED = {
    "SlidingWindowMLASpec": "sliding-window MLA keeps a ring of latents per request",
    "SinkFullAttentionSpec": "attention sinks keep extra per-request pages",
    "RSWASpec": "its pages are not plain attention pages",
    "HiddenStateCacheSpec": "it caches hidden states, not KV",
    "ChunkedLocalAttentionSpec": "chunked local attention frees blocks per chunk",
    "CircularBufferSpec": "a circular buffer has no block per token position",
    "EncoderOnlyAttentionSpec": "encoder-only attention keeps no KV between steps",
    "CrossAttentionSpec": "cross-attention KV comes from the encoder, not the prompt",
    "HiSparseHotSpec": "HiSparse pages are ephemeral per request",
    "HiSparseResidentSpec": "HiSparse pages are ephemeral per request",
}
_LAYOUT_LETTERS = frozenset("LBHNC")


def see_doc(text: str) -> str:
    """``text`` pointing at docs/vllm.md once: the pointer is appended only when ``text`` (say a
    wrapped error whose fix names it already) does not carry it."""
    return text if DOC in text else f"{text} (see {DOC})"


def layout_name(layout: Any) -> str:
    """``KVCacheLayout.LBHNC`` / ``"LBHNC"`` / ``None`` -> ``"LBHNC"`` (vLLM's default)."""
    if layout is None:
        return "LBNHC"
    name = str(getattr(layout, "name", layout)).rsplit(".", 1)[-1].upper()
    if len(name) != 5 or set(name) != _LAYOUT_LETTERS:
        raise SpecError(
            f"unknown vLLM KV cache layout {layout!r}",
            fix=f"use one of vLLM's KVCacheLayout names such as LBHNC or LBNHC (see {DOC})",
        )
    return name


def resolved_layout(vllm_config: Any, kv_cache_config: Any) -> Any:
    """The KV cache layout vLLM lays this cache out in: ``kv_cache_config``'s, else the one
    ``cache_config`` resolves."""
    layout = kv_cache_config.kv_cache_layout
    if layout is None:
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    return layout


def page_layout(layout: str) -> tuple[Layout, bool]:
    """kvxferd attention layout for a vLLM layout, and whether blocks are layer-outermost."""
    pos = {c: i for i, c in enumerate(layout)}
    if pos["H"] > pos["B"] and pos["N"] > pos["B"] and pos["C"] == 4 and pos["L"] < pos["H"]:
        # [H, N, C] of one layer's block is one contiguous span.
        return (Layout.HND if pos["H"] < pos["N"] else Layout.NHD), pos["L"] < pos["B"]
    raise SpecError(
        f"vLLM KV cache layout {layout} does not keep one layer's block as one contiguous span"
        " (a head or layer dim sits outside the block dim)",
        fix=f"run vLLM with a blocks-first layout such as LBHNC, LBNHC or BLHNC (see {DOC})",
    )


def class_names(obj: Any) -> list[str]:
    return [c.__name__ for c in type(obj).__mro__]


def group_kind(spec: Any, where: str) -> GroupKind:
    names = class_names(spec)
    if names[0] in _REFUSED:
        raise SpecError(
            f"{where}: vLLM {names[0]} cannot be moved by kvxferd: {_REFUSED[names[0]]}",
            fix=f"serve this model without disaggregation, or see {DOC} for what is supported",
        )
    for n in names:
        if n in _KINDS:
            return _KINDS[n]
        if n in _REFUSED:
            raise SpecError(
                f"{where}: vLLM {names[0]} (a {n}) cannot be moved by kvxferd: {_REFUSED[n]}",
                fix=f"see {DOC} for the supported KV cache kinds",
            )
    raise SpecError(
        f"{where}: vLLM KV cache spec {names[0]} is not one kvxferd knows",
        fix="kvxferd moves FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec and"
        f" MambaSpec groups (see {DOC})",
    )


# vLLM stores fp8 KV caches as torch.uint8 and keeps the element format in
# cache_config.cache_dtype ("fp8" is e4m3 on CUDA). Other uint8 cache dtypes (fp8_ds_mla:
# fp8 values packed with their scales) are not plain elements and stay refused.
_FP8_CACHE_DTYPES = {
    "fp8": KVDType.FP8_E4M3,
    "fp8_e4m3": KVDType.FP8_E4M3,
    "fp8_e5m2": KVDType.FP8_E5M2,
}


def kv_dtype(dtype: Any, where: str, cache_dtype: str = "auto") -> KVDType:
    """The kvxferd dtype of a vLLM spec's ``dtype``; ``cache_dtype`` is vLLM's
    ``cache_config.cache_dtype``, which says what a ``torch.uint8`` cache holds."""
    if str(dtype).removeprefix("torch.") == "uint8":
        found = _FP8_CACHE_DTYPES.get(str(cache_dtype).strip().lower())
        if found is None:
            raise SpecError(
                f"{where}: vLLM's KV cache holds torch.uint8 with cache_dtype {cache_dtype!r};"
                " kvxferd reads uint8 only as an fp8 cache (cache_dtype fp8, fp8_e4m3 or"
                " fp8_e5m2)",
                fix="run vLLM with --kv-cache-dtype auto, bfloat16, float16, fp8, fp8_e4m3 or"
                f" fp8_e5m2 (see {DOC})",
            )
        return found
    try:
        return KVDType.from_torch_name(str(dtype))
    except ValueError as exc:
        raise SpecError(
            f"{where}: {exc}",
            fix=f"run vLLM with --kv-cache-dtype auto, bfloat16, float16 or fp8 (see {DOC})",
        ) from exc


def layer_spec(group_spec: Any, layer: str) -> Any:
    if "UniformTypeKVCacheSpecs" in class_names(group_spec):
        return group_spec.kv_cache_specs[layer]
    return group_spec


def check_plain_attention(spec: Any, where: str, mla: bool) -> None:
    """Refuse packed or quantised pages whose content is not plain K/V (or latent) elements."""
    problems = []
    if int(getattr(spec, "kv_quant_mode", 0) or 0) > 1:  # NONE or FP8_PER_TENSOR only
        problems.append(f"quantisation mode {spec.kv_quant_mode}")
    if getattr(spec, "state_content_bytes", None) is not None:
        problems.append("packed page content (state_content_bytes)")
    if getattr(spec, "num_head_slots", None) is not None:
        problems.append("packed head slots (num_head_slots)")
    if getattr(spec, "tokens_per_state", 1) != 1:
        problems.append(f"{spec.tokens_per_state} tokens per stored state")
    if not mla and getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        problems.append(f"K head size {spec.head_size} != V head size {spec.head_size_v}")
    if getattr(spec, "page_size_padded", None) is not None:
        problems.append("padded pages")
    if problems:
        raise SpecError(
            f"{where}: kvxferd cannot describe this vLLM attention page: " + "; ".join(problems),
            fix=f"run vLLM with an unquantised (or fp8) KV cache dtype (see {DOC})",
        )


__all__ = [
    "DOC",
    "check_plain_attention",
    "class_names",
    "group_kind",
    "kv_dtype",
    "layer_spec",
    "layout_name",
    "page_layout",
    "resolved_layout",
    "see_doc",
]
