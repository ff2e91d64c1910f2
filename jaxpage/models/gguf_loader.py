"""Loads a GGUF file: config from its metadata, tensors dequantized to float with the `gguf` package.

llama.cpp's converter permutes the rows of the Llama Q and K projections so that RoPE rotates
interleaved pairs; jaxpage (like transformers) rotates halves, so that permutation is undone here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np

from jaxpage.config import ModelConfig
from jaxpage.errors import ModelLoadError
from jaxpage.models.weights import params_from_hf_tensors

# GGUF general.architecture -> jaxpage architecture. Mistral models are written as "llama".
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# Types jaxpage dequantizes (all through gguf.quants.dequantize); anything else is refused by name.
SUPPORTED_TENSOR_TYPES = {
    gguf.GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
}

GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}


def hf_name(gguf_name: str) -> str | None:
    """The transformers name of a GGUF tensor, or None for tensors jaxpage does not use."""
    if gguf_name in GLOBAL_TENSOR_NAMES:
        return GLOBAL_TENSOR_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_TENSOR_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_TENSOR_NAMES[parts[2]]}"
    return None


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permutation: rows (per head) from interleaved pairs back to halves."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise ModelLoadError(f"{path}: file not found")
    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as e:  # truncated or not GGUF: the reader fails with ValueError/IndexError/...
        raise ModelLoadError(f"{path}: not a valid GGUF file, truncated or damaged ({type(e).__name__}: {e})") from None


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def config_from_gguf(reader: gguf.GGUFReader, path: Path) -> ModelConfig:
    gguf_arch = _field(reader, "general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {gguf_arch!r} is not supported; jaxpage reads {', '.join(GGUF_ARCHITECTURES)}"
        )
    tensor_names = {t.name for t in reader.tensors}

    def meta(key: str, default=None):
        value = _field(reader, f"{gguf_arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata {gguf_arch}.{key} is missing")
        return value

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    vocab = _field(reader, f"{gguf_arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    head_dim = _field(reader, f"{gguf_arch}.attention.key_length") or _field(
        reader, f"{gguf_arch}.rope.dimension_count"
    )
    rope_scaling = None
    if _field(reader, f"{gguf_arch}.rope.scaling.type", "none") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    hf_like = {
        "model_type": GGUF_ARCHITECTURES[gguf_arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(head_dim or hidden // heads),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(meta("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_gate.bias" in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
    }
    config = ModelConfig.from_hf_config(hf_like, source=str(path))
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:  # Llama 3.x: the RoPE scaling as one divisor per frequency
        factors = np.asarray(rope_freqs.data, np.float32).reshape(-1)
        if factors.size != config.head_dim // 2:
            raise ModelLoadError(
                f"{path}: tensor 'rope_freqs.weight' has {factors.size} values, expected head_dim / 2 = "
                f"{config.head_dim // 2}"
            )
        config = dataclasses.replace(config, rope_freq_factors=tuple(float(f) for f in factors))
    return config


class GGUFSource:
    """TensorSource over a GGUF file: tensors renamed to transformers names and dequantized on demand."""

    def __init__(self, reader: gguf.GGUFReader, config: ModelConfig, path: Path):
        self._path = path
        self._config = config
        self._tensors = {}
        for tensor in reader.tensors:
            name = hf_name(tensor.name)
            if name is not None:
                self._tensors[name] = tensor

    def names(self) -> set[str]:
        return set(self._tensors)

    def file_of(self, name: str) -> str:
        return str(self._path)

    def get(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(
                f"{self._path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which jaxpage does not "
                f"dequantize (supported: {', '.join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))})"
            )
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        weights = weights.reshape([int(n) for n in reversed(tensor.shape)])  # GGUF lists dims fastest-first
        c = self._config
        if c.architecture == "llama":
            for suffix, heads in (("q_proj", c.num_heads), ("k_proj", c.num_kv_heads)):
                # A wrongly shaped tensor is left as it is, for the shape check to report.
                if name.endswith((f"{suffix}.weight", f"{suffix}.bias")) and weights.shape[0] == heads * c.head_dim:
                    weights = unpermute_rows(weights, heads)
        return weights


def load_gguf(path: Path, dtype) -> tuple[ModelConfig, dict]:
    """(config, numpy parameter tree) from a GGUF file."""
    reader = open_gguf(path)
    config = config_from_gguf(reader, path)
    return config, params_from_hf_tensors(config, GGUFSource(reader, config, path), dtype)
