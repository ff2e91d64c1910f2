"""Loads a GGUF file: config from its metadata, tensors dequantized to float32.

The file is parsed by `gguf_file` (tensors stay memory-mapped) and dequantized by `gguf_dequant`. llama.cpp's
converter permutes the rows of the Llama Q and K projections so that RoPE rotates interleaved pairs; jaxpage (like
transformers) rotates halves, so that permutation is undone here.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from jaxpage.config import ModelConfig, model_config_from_hf
from jaxpage.errors import ModelLoadError
from jaxpage.models.gguf_dequant import SUPPORTED_TYPES, dequantize, dequantize_transposed
from jaxpage.models.gguf_file import GGUFFile, GGUFTensor, read_gguf
from jaxpage.models.weights import expert_projection_names, moe_block_name, params_from_hf_tensors
from jaxpage.validation import describe

# GGUF general.architecture -> jaxpage architecture. Mistral models are written as "llama", and so is Mixtral (a
# "llama" with {arch}.expert_count).
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",  # Phi-3, Phi-3.5, Phi-4-mini (and Phi-4)
}

# Types jaxpage dequantizes; anything else is refused by name.
SUPPORTED_TENSOR_TYPES = SUPPORTED_TYPES

EMBEDDING = "model.embed_tokens.weight"  # the only 2-D tensor the model keeps as stored; the rest are linear layers

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


# A mixture of experts' layer tensors: llama.cpp keeps each projection of every expert in one [E, out, in] tensor
# (the experts' names: weights.expert_projection_names), the router and Qwen2-MoE's shared expert as the names below
# say (the block: weights.moe_block_name).
STACKED_EXPERT_TENSORS = {"ffn_gate_exps.weight": 0, "ffn_up_exps.weight": 1, "ffn_down_exps.weight": 2}
MOE_LAYER_TENSOR_NAMES = {
    "ffn_gate_inp.weight": "{block}.gate.weight",
    "ffn_gate_shexp.weight": "{block}.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "{block}.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "{block}.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "{block}.shared_expert_gate.weight",  # [D] in GGUF, [1, D] in transformers
}


# Gemma's norms in llama.cpp's names, where they differ from Llama's (whose ffn_norm is the norm before the MLP,
# transformers' post_attention_layernorm in Llama and pre_feedforward_layernorm in Gemma).
GEMMA_LAYER_TENSOR_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


# Phi-3's fused projections in llama.cpp's names, where they differ from Llama's: attn_qkv is transformers' qkv_proj
# (q's rows, then k's, then v's, not permuted: llama.cpp rotates Phi-3's halves, as transformers does) and ffn_up its
# gate_up_proj (gate's rows, then up's; there is no ffn_gate). weights.py splits them as it splits a checkpoint's.
PHI3_LAYER_TENSOR_NAMES = {
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
# Phi-3's LongRoPE factors (one divisor per rotated pair of dimensions): transformers' short_factor and long_factor.
PHI3_ROPE_FACTORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}


# config.json's fields by their GGUF metadata keys (after `{general.architecture}.`).
METADATA_KEYS = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "rope_scaling.factor": "rope.scaling.factor",
    "sliding_window": "attention.sliding_window",
    "max_position_embeddings": "context_length",
    "vocab_size": "vocab_size",
    "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
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


def open_gguf(path: Path) -> GGUFFile:
    if not path.is_file():
        raise ModelLoadError(f"{path}: file not found")
    return read_gguf(path)


def config_from_gguf(gguf: GGUFFile, path: Path, overrides: dict | None = None) -> ModelConfig:
    """The model's config from the file's metadata, `overrides` (hf_overrides: Hugging Face config fields) set over
    it."""
    gguf_arch = gguf.metadata.get("general.architecture")
    if not isinstance(gguf_arch, str) or gguf_arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {describe(gguf_arch)} is not supported; jaxpage reads "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )

    def field(key: str, default=None) -> Any:
        """A number from the metadata (default when absent); ModelLoadError when it is not a number."""
        value = gguf.metadata.get(key, default)
        if value is not None and (isinstance(value, (bool, str)) or not isinstance(value, (int, float))):
            raise ModelLoadError(f"{path}: metadata {key} is {describe(value)}, not a number")
        return value

    def text(key: str, default: str) -> str:
        """A string from the metadata (default when absent)."""
        value = gguf.metadata.get(key, default)
        if not isinstance(value, str):
            raise ModelLoadError(f"{path}: metadata {key} must be a string, got {describe(value)}")
        return value

    def meta(key: str, default=None) -> Any:
        value = field(f"{gguf_arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: metadata {gguf_arch}.{key} is missing")
        return value

    # The numbers go to model_config_from_hf as stored, which checks them and names each by its metadata key.
    names = {hf_key: f"metadata {gguf_arch}.{key}" for hf_key, key in METADATA_KEYS.items()}
    names |= {f"{token}_token_id": f"metadata tokenizer.ggml.{token}_token_id" for token in ("bos", "eos")}
    names["sliding_window_pattern"] = names["layer_types"] = f"metadata {gguf_arch}.attention.sliding_window_pattern"
    vocab = field(f"{gguf_arch}.vocab_size")
    if vocab is None:  # llama.cpp's vocabulary is the token list; vocab_size is optional
        vocab = _token_count(gguf, path)
        names["vocab_size"] = "the number of tokenizer.ggml.tokens"
    head_dim = field(f"{gguf_arch}.attention.key_length")
    # (Phi-3's rope.dimension_count is its rotary dim, not its head_dim: see _phi3_fields.)
    if head_dim is None and gguf_arch != "phi3" and field(f"{gguf_arch}.rope.dimension_count") is not None:
        head_dim = field(f"{gguf_arch}.rope.dimension_count")
        names["head_dim"] = f"metadata {gguf_arch}.rope.dimension_count"
    hf_like = {
        "model_type": GGUF_ARCHITECTURES[gguf_arch],
        "vocab_size": vocab,
        "hidden_size": meta("embedding_length"),
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": meta("attention.head_count"),
        "num_key_value_heads": field(f"{gguf_arch}.attention.head_count_kv"),  # None: as many as the query heads
        "head_dim": head_dim,  # None: embedding_length / head_count
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(text(f"{gguf_arch}.rope.scaling.type", "none"), meta, gguf_arch, path),
        "max_position_embeddings": meta("context_length"),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in gguf.tensors,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),  # checked as a token id by model_config_from_hf
    }
    window = field(f"{gguf_arch}.attention.sliding_window")
    if window and gguf_arch == "llama":  # Mistral's (a "llama" to llama.cpp); Mixtral's, below
        hf_like |= {"model_type": "mistral", "sliding_window": window}
    norm = gguf.metadata.get(f"{gguf_arch}.expert_weights_norm")
    if norm is not None and not isinstance(norm, bool):
        raise ModelLoadError(f"{path}: metadata {gguf_arch}.expert_weights_norm must be a bool, got {describe(norm)}")
    hf_like |= _moe_fields(field, meta, gguf_arch, norm)
    hf_like |= _gemma_fields(field, gguf_arch, hf_like, _window_pattern(gguf, gguf_arch, path))
    hf_like |= _phi3_fields(gguf, path, field, meta, hf_like, names)
    source = str(path) if not overrides else f"{path} with hf_overrides {sorted(overrides)}"
    config = model_config_from_hf(hf_like | (overrides or {}), source=source, names=names)
    return _with_rope_freqs(config, gguf, path)


def _token_count(gguf: GGUFFile, path: Path) -> int:
    """The number of tokenizer.ggml.tokens (llama.cpp's vocabulary size), which must be an array of strings."""
    tokens = gguf.metadata.get("tokenizer.ggml.tokens", [])
    if not isinstance(tokens, list) or not all(isinstance(token, str) for token in tokens):
        got = describe(tokens)
        raise ModelLoadError(f"{path}: metadata tokenizer.ggml.tokens must be an array of strings, got {got}")
    return len(tokens)


def _window_pattern(gguf: GGUFFile, gguf_arch: str, path: Path):
    """Metadata attention.sliding_window_pattern: absent, a period, or an array of bools (one per layer)."""
    pattern = gguf.metadata.get(f"{gguf_arch}.attention.sliding_window_pattern")
    if isinstance(pattern, np.ndarray | list) and not (isinstance(pattern, np.ndarray) and pattern.dtype == bool):
        raise ModelLoadError(
            f"{path}: metadata {gguf_arch}.attention.sliding_window_pattern must be a period or an array of bools (one "
            f"per layer), got {describe(pattern)}"
        )
    return pattern


def _rope_scaling(scaling_type: str, meta, gguf_arch: str, path: Path) -> dict | None:
    """config.json's rope_scaling of metadata rope.scaling.type (linear, or none); Llama 3's comes as a tensor."""
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": meta("rope.scaling.factor")}
    if scaling_type != "none":  # YaRN and others: read as none, positions past the original context would be wrong
        raise ModelLoadError(
            f"{path}: metadata {gguf_arch}.rope.scaling.type {describe(scaling_type)} is not supported (supported: "
            "none, linear; Llama 3's scaling comes as the tensor rope_freqs)"
        )
    return None


def _with_rope_freqs(config: ModelConfig, gguf: GGUFFile, path: Path) -> ModelConfig:
    """Llama 3.x: the RoPE scaling as one divisor per frequency, the tensor rope_freqs (where the file has it)."""
    rope_freqs = gguf.tensors.get("rope_freqs.weight")
    if rope_freqs is None:
        return config
    factors = _dequantize(rope_freqs, path).reshape(-1)
    if factors.size != config.head_dim // 2:
        raise ModelLoadError(
            f"{path}: tensor 'rope_freqs.weight' has {factors.size} values, expected head_dim / 2 = "
            f"{config.head_dim // 2}"
        )
    if not np.all(np.isfinite(factors) & (factors > 0)):
        raise ModelLoadError(f"{path}: tensor 'rope_freqs.weight' must hold positive finite numbers")
    return dataclasses.replace(config, rope_freq_factors=tuple(float(f) for f in factors))


def _gemma_fields(field, gguf_arch: str, hf_like: dict[str, Any], pattern_value) -> dict[str, Any]:
    """Gemma 2 / 3's config.json fields from GGUF metadata (none for other architectures), as llama.cpp reads them:
    the sliding window and soft caps from the metadata; the layer pattern from attention.sliding_window_pattern
    (`pattern_value`), else each family's (Gemma 2 alternating, Gemma 3 every sixth layer global); Gemma 3's local
    RoPE base 10000; and, as GGUF keeps no query_pre_attn_scalar, llama.cpp's rule: hidden_size / heads for the 27B
    models (46 or 62 layers), else head_dim."""
    if gguf_arch not in ("gemma2", "gemma3"):
        return {}
    layers, per_head = hf_like["num_hidden_layers"], _hidden_per_head(hf_like)
    fields = {
        "sliding_window": field(f"{gguf_arch}.attention.sliding_window"),
        "query_pre_attn_scalar": per_head if per_head and layers in (46, 62) else hf_like["head_dim"] or per_head,
    }
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if field(f"{gguf_arch}.{key}") is not None:
            fields[key] = field(f"{gguf_arch}.{key}")
    if gguf_arch == "gemma3":
        fields["rope_local_base_freq"] = 10000.0
    pattern = pattern_value  # a period, or a flag per layer (True: sliding)
    if isinstance(pattern, np.ndarray):
        fields["layer_types"] = ["sliding_attention" if flag else "full_attention" for flag in pattern]
    elif pattern is not None:
        fields["sliding_window_pattern"] = pattern
    elif gguf_arch == "gemma3":
        fields["sliding_window_pattern"] = 6
    return fields


def _hidden_per_head(hf_like: dict[str, Any]) -> int | None:
    """embedding_length / head_count (what head_dim is when attention.key_length is absent), or None where either is
    not a positive integer (model_config_from_hf then names it)."""
    hidden, heads = hf_like["hidden_size"], hf_like["num_attention_heads"]
    return hidden // heads if all(isinstance(n, int) and n > 0 for n in (hidden, heads)) else None


def _phi3_fields(gguf: GGUFFile, path: Path, field, meta, hf_like: dict[str, Any], names: dict[str, str]) -> dict:
    """Phi-3 / Phi-3.5 / Phi-4-mini's config.json fields from GGUF metadata (none for other architectures), as
    llama.cpp's converter writes them: the sliding window (0: none); the partial rotary factor as
    rope.dimension_count, the rotary dim (head_dim: attention.key_length, else embedding_length / head_count); and
    LongRoPE, where the file has the tensors PHI3_ROPE_FACTORS, with rope.scaling.original_context_length (where the
    long factors take over) and rope.scaling.attn_factor (absent: transformers' default). `names` gets their names
    in the file, for model_config_from_hf's messages."""
    if gguf.metadata.get("general.architecture") != "phi3":
        return {}
    fields: dict[str, Any] = {"sliding_window": field("phi3.attention.sliding_window") or None}
    head_dim = hf_like["head_dim"] or _hidden_per_head(hf_like)
    valid_head_dim = isinstance(head_dim, int) and head_dim > 0
    rotary = field("phi3.rope.dimension_count")
    if rotary is not None and valid_head_dim:
        if not (isinstance(rotary, int) and 0 < rotary <= head_dim and rotary % 2 == 0):
            raise ModelLoadError(
                f"{path}: metadata phi3.rope.dimension_count must be an even number from 2 to head_dim "
                f"({head_dim}), got {rotary!r}"
            )
        factor = rotary / head_dim  # from which transformers' int(head_dim * factor) must give rotary back
        fields["partial_rotary_factor"] = factor if int(head_dim * factor) == rotary else math.nextafter(factor, 1)
        names["partial_rotary_factor"] = "metadata phi3.rope.dimension_count / head_dim"
    factors = _phi3_rope_factors(gguf, path, (rotary or head_dim) // 2 if valid_head_dim else None)
    if factors is None:
        return fields
    rope: dict[str, Any] = {"rope_type": "longrope", **factors}
    if field("phi3.rope.scaling.attn_factor") is not None:
        rope["attention_factor"] = field("phi3.rope.scaling.attn_factor")
    names["rope_scaling.attention_factor"] = "metadata phi3.rope.scaling.attn_factor"
    names["original_max_position_embeddings"] = "metadata phi3.rope.scaling.original_context_length"
    original = meta("rope.scaling.original_context_length")  # transformers reads it at the top level for phi3
    return fields | {"rope_scaling": rope, "original_max_position_embeddings": original}


def _phi3_rope_factors(gguf: GGUFFile, path: Path, pairs: int | None) -> dict[str, list[float]] | None:
    """LongRoPE's short_factor and long_factor from the tensors PHI3_ROPE_FACTORS (None where the file has neither),
    each checked to hold `pairs` (the rotary dim / 2; None: unchecked here) positive finite numbers."""
    present = [tensor for tensor in PHI3_ROPE_FACTORS.values() if tensor in gguf.tensors]
    if not present:
        return None
    factors = {}
    for key, tensor in PHI3_ROPE_FACTORS.items():
        if tensor not in gguf.tensors:
            raise ModelLoadError(f"{path}: tensor {tensor!r} is missing (LongRoPE: the file has {present[0]!r})")
        values = _dequantize(gguf.tensors[tensor], path).reshape(-1)
        if pairs is not None and values.size != pairs:
            raise ModelLoadError(
                f"{path}: tensor {tensor!r} has {values.size} values, expected the rotary dim / 2 = {pairs}"
            )
        if not np.all(np.isfinite(values) & (values > 0)):
            raise ModelLoadError(f"{path}: tensor {tensor!r} must hold positive finite numbers")
        factors[key] = [float(f) for f in values]
    return factors


def _moe_fields(field, meta, gguf_arch: str, norm) -> dict[str, Any]:
    """A mixture of experts' config.json fields from GGUF metadata (none for a dense model): Mixtral is a "llama"
    with an expert_count; Qwen3-MoE renormalizes its routing weights as llama.cpp does (Qwen2-MoE does not), unless
    expert_weights_norm says otherwise."""
    experts = field(f"{gguf_arch}.expert_count")
    if gguf_arch == "llama" and not experts:
        return {}
    if gguf_arch == "llama":
        return {"model_type": "mixtral", "num_experts": experts, "num_experts_per_tok": meta("expert_used_count")}
    if gguf_arch not in ("qwen2moe", "qwen3moe"):
        return {}
    return {
        "num_experts": meta("expert_count"),
        "num_experts_per_tok": meta("expert_used_count"),
        "moe_intermediate_size": meta("expert_feed_forward_length"),
        "shared_expert_intermediate_size": field(f"{gguf_arch}.expert_shared_feed_forward_length"),
        "norm_topk_prob": (gguf_arch == "qwen3moe") if norm is None else bool(norm),
    }


def _check_type(tensor: GGUFTensor, path: Path) -> None:
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which jaxpage does not "
            f"dequantize (supported: {', '.join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))})"
        )


def _dequantize(tensor: GGUFTensor, path: Path) -> np.ndarray:
    _check_type(tensor, path)
    return dequantize(tensor.data, tensor.tensor_type, tensor.shape)


class GGUFSource:
    """TensorSource over a GGUF file: tensors renamed to transformers names and dequantized on demand.

    A linear layer's weight [out, in] comes back as the transpose of a C-contiguous [in, out] array (Fortran order):
    the model keeps kernels [in, out], so the caller's transpose is then free, and dequantizing straight into that
    layout is faster than dequantizing rows and transposing them after.
    """

    def __init__(self, gguf: GGUFFile, config: ModelConfig, path: Path):
        self._path = path
        self._config = config
        self._tensors = {}
        self._experts: dict[str, tuple[GGUFTensor, int]] = {}  # an expert's name -> (its stacked tensor, its index)
        self._stacked: tuple[str, np.ndarray] | None = None  # the last stacked tensor dequantized
        renames = GEMMA_LAYER_TENSOR_NAMES if config.sandwich_norms else {}
        renames = PHI3_LAYER_TENSOR_NAMES if config.architecture == "phi3" else renames
        for tensor in gguf.tensors.values():
            name = self._renamed(tensor.name, renames) or hf_name(tensor.name)
            if name is not None:
                self._tensors[name] = tensor
            elif config.is_moe:
                self._add_moe_tensor(tensor)

    @staticmethod
    def _renamed(gguf_name: str, renames: dict[str, str]) -> str | None:
        """The transformers name of a layer's tensor that the architecture names differently from Llama (`renames`:
        GEMMA_LAYER_TENSOR_NAMES, PHI3_LAYER_TENSOR_NAMES), else None."""
        parts = gguf_name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in renames:
            return f"model.layers.{parts[1]}.{renames[parts[2]]}"
        return None

    def _add_moe_tensor(self, tensor: GGUFTensor) -> None:
        parts = tensor.name.split(".", 2)
        if len(parts) != 3 or parts[0] != "blk":
            return
        arch, layer, suffix = self._config.architecture, parts[1], parts[2]
        if suffix in MOE_LAYER_TENSOR_NAMES:
            self._tensors[
                f"model.layers.{layer}.{MOE_LAYER_TENSOR_NAMES[suffix].format(block=moe_block_name(arch))}"
            ] = tensor
        elif suffix in STACKED_EXPERT_TENSORS and len(tensor.shape) == 3:
            projection = expert_projection_names(arch)[STACKED_EXPERT_TENSORS[suffix]]
            for j in range(tensor.shape[0]):
                self._experts[f"model.layers.{layer}.{moe_block_name(arch)}.experts.{j}.{projection}.weight"] = (
                    tensor,
                    j,
                )

    def names(self) -> set[str]:
        return set(self._tensors) | set(self._experts)

    def file_of(self, name: str) -> str:
        return str(self._path)

    def get(self, name: str) -> np.ndarray:
        if name in self._experts:
            return self._expert(*self._experts[name])
        tensor = self._tensors[name]
        _check_type(tensor, self._path)
        if name.endswith("shared_expert_gate.weight") and len(tensor.shape) == 1:
            return dequantize(tensor.data, tensor.tensor_type, tensor.shape)[None]
        heads = self._permuted_heads(name, tensor.shape)
        if len(tensor.shape) == 2 and name != EMBEDDING:
            # Unpermuting the row numbers gives the stored row for each row of the result: the bytes are gathered.
            order = None if heads is None else unpermute_rows(np.arange(tensor.shape[0]), heads)
            return dequantize_transposed(tensor.data, tensor.tensor_type, tensor.shape, order).T
        weights = dequantize(tensor.data, tensor.tensor_type, tensor.shape)
        if self._config.norm_weight_offset and name.endswith("norm.weight"):
            return weights - self._config.norm_weight_offset  # llama.cpp stores Gemma's norms as 1 + weight
        return weights if heads is None else unpermute_rows(weights, heads)

    def _expert(self, tensor: GGUFTensor, j: int) -> np.ndarray:
        """Expert j's [out, in] weight from a stacked [E, out, in] tensor, dequantized once for all its experts."""
        if self._stacked is None or self._stacked[0] != tensor.name:
            _check_type(tensor, self._path)
            self._stacked = (tensor.name, dequantize(tensor.data, tensor.tensor_type, tensor.shape))
        return self._stacked[1][j]

    def _permuted_heads(self, name: str, shape: tuple[int, ...]) -> int | None:
        """The head count whose row permutation llama.cpp applied to tensor `name`, or None."""
        c = self._config
        if c.architecture in ("llama", "mistral", "mixtral"):  # llama.cpp writes each as "llama"
            for suffix, heads in (("q_proj", c.num_heads), ("k_proj", c.num_kv_heads)):
                # A wrongly shaped tensor is left as it is, for the shape check to report.
                if name.endswith((f"{suffix}.weight", f"{suffix}.bias")) and shape[0] == heads * c.head_dim:
                    return heads
        return None


def load_gguf(
    path: Path, dtype, quantization: str | None = None, overrides: dict | None = None
) -> tuple[ModelConfig, dict]:
    """(config, numpy parameter tree) from a GGUF file (quantization: see params_from_hf_tensors; overrides: see
    config_from_gguf)."""
    gguf = open_gguf(path)
    config = config_from_gguf(gguf, path, overrides)
    params = params_from_hf_tensors(config, GGUFSource(gguf, config, path), dtype, quantization)
    return dataclasses.replace(config, quantization=quantization), params
