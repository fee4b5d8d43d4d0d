"""KV cache element types, named the way operators write them (``bf16``, ``fp8_e4m3``, ...)."""

from __future__ import annotations

from enum import StrEnum


class KVDType(StrEnum):
    """Element type of one region. Peers must agree region by region (seed 001)."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def torch_name(self) -> str:
        """The ``torch`` attribute name of this dtype (``torch.<name>``)."""
        return _TORCH_NAME[self]

    @classmethod
    def parse(cls, text: str) -> KVDType:
        key = text.strip().lower()
        found = _ALIASES.get(key)
        if found is None:
            allowed = ", ".join(d.value for d in cls)
            raise ValueError(f"unknown KV dtype {text!r}; use one of {allowed}")
        return found

    @classmethod
    def from_torch_name(cls, name: str) -> KVDType:
        """Map ``str(torch.dtype)`` (``"torch.bfloat16"``) or its bare name to a KVDType."""
        bare = name.removeprefix("torch.")
        for d, tname in _TORCH_NAME.items():
            if tname == bare:
                return d
        allowed = ", ".join(_TORCH_NAME.values())
        raise ValueError(f"torch dtype {name} is not a supported KV dtype ({allowed})")


_ITEMSIZE = {
    KVDType.BF16: 2,
    KVDType.FP16: 2,
    KVDType.FP32: 4,
    KVDType.FP8_E4M3: 1,
    KVDType.FP8_E5M2: 1,
}

_TORCH_NAME = {
    KVDType.BF16: "bfloat16",
    KVDType.FP16: "float16",
    KVDType.FP32: "float32",
    KVDType.FP8_E4M3: "float8_e4m3fn",
    KVDType.FP8_E5M2: "float8_e5m2",
}

_ALIASES: dict[str, KVDType] = {d.value: d for d in KVDType}
_ALIASES.update(
    {
        "bfloat16": KVDType.BF16,
        "float16": KVDType.FP16,
        "half": KVDType.FP16,
        "float32": KVDType.FP32,
        "float": KVDType.FP32,
        "fp8": KVDType.FP8_E4M3,
        "float8_e4m3fn": KVDType.FP8_E4M3,
        "fp8_e4m3fn": KVDType.FP8_E4M3,
        "float8_e5m2": KVDType.FP8_E5M2,
    }
)
