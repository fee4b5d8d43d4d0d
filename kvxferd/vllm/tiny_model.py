"""A tiny Llama checkpoint with random weights at normal scale, written locally (no download).

2 layers, hidden 128, 4 heads, 2 KV heads, head_dim 32, vocab 1024, bf16: about 1 MB of
safetensors (written by hand: an 8-byte header length, a JSON header, the raw bytes) plus a
``config.json``. Weights drawn at the usual ``1/sqrt(fan_in)`` scale make the greedy output
depend on every prompt token, so a decode engine that recomputed the prompt instead of using
the pulled KV cache would produce different tokens (vLLM's ``load_format="dummy"`` weights are
too small for that). No tokenizer: prompts are token IDs.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
}
VOCAB = int(CONFIG["vocab_size"])  # type: ignore[call-overload]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = int(CONFIG["hidden_size"])  # type: ignore[call-overload]
    inter = int(CONFIG["intermediate_size"])  # type: ignore[call-overload]
    heads, kv, hd = 4, 2, 32

    def rand(*shape: int, std: float | None = None) -> torch.Tensor:
        scale = std if std is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    ones = torch.ones(h, dtype=torch.bfloat16)
    out = {
        "model.embed_tokens.weight": rand(VOCAB, h, std=1.0),
        "model.norm.weight": ones,
        "lm_head.weight": rand(VOCAB, h),
    }
    for layer in range(int(CONFIG["num_hidden_layers"])):  # type: ignore[call-overload]
        p = f"model.layers.{layer}."
        out[p + "self_attn.q_proj.weight"] = rand(heads * hd, h)
        out[p + "self_attn.k_proj.weight"] = rand(kv * hd, h)
        out[p + "self_attn.v_proj.weight"] = rand(kv * hd, h)
        out[p + "self_attn.o_proj.weight"] = rand(h, heads * hd)
        out[p + "mlp.gate_proj.weight"] = rand(inter, h)
        out[p + "mlp.up_proj.weight"] = rand(inter, h)
        out[p + "mlp.down_proj.weight"] = rand(h, inter)
        out[p + "input_layernorm.weight"] = ones.clone()
        out[p + "post_attention_layernorm.weight"] = ones.clone()
    return out


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """bf16 tensors in the safetensors format."""
    header: dict[str, object] = {}
    blobs = []
    pos = 0
    for name, t in tensors.items():
        data = t.contiguous().view(torch.int16).numpy().tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(t.shape),
            "data_offsets": [pos, pos + len(data)],
        }
        blobs.append(data)
        pos += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


def write_tiny_llama(directory: Path, seed: int = 0) -> Path:
    """Write the checkpoint into ``directory`` (created); returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=1))
    write_safetensors(directory / "model.safetensors", _weights(seed))
    return directory
