"""Turns checkpoint tensors in Hugging Face names and layout into jaxpage's parameter tree.

Every weight format (safetensors, GGUF) first presents its tensors under their transformers names in
torch layout (`Linear.weight` is [out, in]); this module checks each shape against the config and
builds the scanned tree documented in `jaxpage.models.llama`. One mapping serves all formats.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from jaxpage.config import ModelConfig
from jaxpage.errors import ModelLoadError


class TensorSource(Protocol):
    """Tensors of one checkpoint under transformers names, in torch layout, as numpy arrays."""

    def names(self) -> set[str]: ...

    def get(self, name: str) -> np.ndarray: ...

    def file_of(self, name: str) -> str:
        """The file that holds (or should hold) `name`, for error messages."""
        ...


def _linear(heads_out: int | None = None, heads_in: int | None = None, head_dim: int = 0) -> Callable:
    """torch Linear weight [out, in] -> kernel [in, out], with head axes split out where asked."""

    def convert(w: np.ndarray) -> np.ndarray:
        kernel = w.T
        if heads_out is not None:
            kernel = kernel.reshape(kernel.shape[0], heads_out, head_dim)
        if heads_in is not None:
            kernel = kernel.reshape(heads_in, head_dim, kernel.shape[-1])
        return kernel

    return convert


def _bias(heads: int | None = None, head_dim: int = 0) -> Callable:
    return (lambda b: b.reshape(heads, head_dim)) if heads is not None else (lambda b: b)


def _same(x: np.ndarray) -> np.ndarray:
    return x


def layer_tensor_specs(c: ModelConfig) -> list[tuple[str, tuple[str, ...], tuple[int, ...], Callable]]:
    """(name inside `layers.{i}.`, parameter path under `layers`, torch shape, torch -> jaxpage transform)."""
    d, hd, f = c.hidden_size, c.head_dim, c.intermediate_size
    qd, kd = c.num_heads * hd, c.num_kv_heads * hd
    specs = [
        ("input_layernorm.weight", ("input_norm", "scale"), (d,), _same),
        ("self_attn.q_proj.weight", ("attn", "q_proj", "kernel"), (qd, d), _linear(heads_out=c.num_heads, head_dim=hd)),
        (
            "self_attn.k_proj.weight",
            ("attn", "k_proj", "kernel"),
            (kd, d),
            _linear(heads_out=c.num_kv_heads, head_dim=hd),
        ),
        (
            "self_attn.v_proj.weight",
            ("attn", "v_proj", "kernel"),
            (kd, d),
            _linear(heads_out=c.num_kv_heads, head_dim=hd),
        ),
        ("self_attn.o_proj.weight", ("attn", "o_proj", "kernel"), (d, qd), _linear(heads_in=c.num_heads, head_dim=hd)),
        ("post_attention_layernorm.weight", ("post_attention_norm", "scale"), (d,), _same),
        ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), (f, d), _linear()),
        ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), (f, d), _linear()),
        ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), (d, f), _linear()),
    ]
    if c.qkv_bias:
        specs += [
            ("self_attn.q_proj.bias", ("attn", "q_proj", "bias"), (qd,), _bias(c.num_heads, hd)),
            ("self_attn.k_proj.bias", ("attn", "k_proj", "bias"), (kd,), _bias(c.num_kv_heads, hd)),
            ("self_attn.v_proj.bias", ("attn", "v_proj", "bias"), (kd,), _bias(c.num_kv_heads, hd)),
        ]
    if c.o_bias:
        specs.append(("self_attn.o_proj.bias", ("attn", "o_proj", "bias"), (d,), _same))
    if c.qk_norm:
        specs += [
            ("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), (hd,), _same),
            ("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), (hd,), _same),
        ]
    if c.mlp_bias:
        specs += [
            ("mlp.gate_proj.bias", ("mlp", "gate_proj", "bias"), (f,), _same),
            ("mlp.up_proj.bias", ("mlp", "up_proj", "bias"), (f,), _same),
            ("mlp.down_proj.bias", ("mlp", "down_proj", "bias"), (d,), _same),
        ]
    return specs


def params_from_hf_tensors(config: ModelConfig, source: TensorSource, dtype) -> dict:
    """The parameter tree (numpy arrays of `dtype`) from a checkpoint's tensors.

    Raises ModelLoadError naming the file and the tensor when one is missing or has the wrong shape.
    """
    c = config
    dtype = np.dtype(dtype)
    available = source.names()
    prefix = "model." if "model.embed_tokens.weight" in available or "embed_tokens.weight" not in available else ""

    def load(name: str, shape: tuple[int, ...], convert: Callable = _same) -> np.ndarray:
        if name not in available:
            raise ModelLoadError(f"{source.file_of(name)}: tensor {name!r} is missing")
        try:
            tensor = source.get(name)
        except ModelLoadError:
            raise
        except Exception as e:  # a truncated or corrupt file surfaces here, from whichever reader
            raise ModelLoadError(f"{source.file_of(name)}: cannot read tensor {name!r} ({e})") from None
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"{source.file_of(name)}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}"
            )
        return convert(tensor)

    layers: dict = {}
    for suffix, path, shape, convert in layer_tensor_specs(c):
        stacked = None
        for i in range(c.num_layers):  # each layer written once, straight into the stacked array
            tensor = load(f"{prefix}layers.{i}.{suffix}", shape, convert)
            if stacked is None:
                stacked = np.empty((c.num_layers, *tensor.shape), dtype)
            stacked[i] = tensor
        node = layers
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = stacked

    def load_one(name: str, shape: tuple[int, ...], convert: Callable = _same) -> np.ndarray:
        return np.ascontiguousarray(load(name, shape, convert).astype(dtype, copy=False))

    params = {
        "embed_tokens": {"embedding": load_one(f"{prefix}embed_tokens.weight", (c.vocab_size, c.hidden_size))},
        "layers": layers,
        "norm": {"scale": load_one(f"{prefix}norm.weight", (c.hidden_size,))},
    }
    if not c.tie_word_embeddings:
        params["lm_head"] = {"kernel": load_one("lm_head.weight", (c.vocab_size, c.hidden_size), _linear())}
    return params
