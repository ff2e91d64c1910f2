"""Turns checkpoint tensors in Hugging Face names and layout into jaxpage's parameter tree.

Every weight format (safetensors, GGUF) first presents its tensors under their transformers names in
torch layout (`Linear.weight` is [out, in]); this module checks each shape against the config and
builds the scanned tree documented in `jaxpage.models.llama`. One mapping serves all formats.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import numpy as np

from jaxpage.config import ModelConfig
from jaxpage.errors import ModelLoadError
from jaxpage.models.int8 import quantize
from jaxpage.models.quantized.readers import read_projection


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
    ]
    if c.sandwich_norms:  # Gemma: post_attention_layernorm norms the attention's output, pre_feedforward_layernorm
        # is the norm before the MLP (Llama's post_attention_layernorm), post_feedforward_layernorm the MLP's output
        specs = [spec for spec in specs if spec[0] != "post_attention_layernorm.weight"] + [
            ("post_attention_layernorm.weight", ("attn_output_norm", "scale"), (d,), _same),
            ("pre_feedforward_layernorm.weight", ("post_attention_norm", "scale"), (d,), _same),
            ("post_feedforward_layernorm.weight", ("mlp_output_norm", "scale"), (d,), _same),
        ]
    if c.is_moe:
        specs += _moe_router_specs(c)
    else:
        specs += [
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
    if c.architecture == "phi3":
        specs = _phi3_fused_specs(c, specs)
    return specs


def _rows(start: int, stop: int, convert: Callable) -> Callable:
    """`convert` of rows start:stop of a fused torch weight [out, in]."""
    return lambda w: convert(w[start:stop])


def _phi3_fused_specs(
    c: ModelConfig, specs: list[tuple[str, tuple[str, ...], tuple[int, ...], Callable]]
) -> list[tuple[str, tuple[str, ...], tuple[int, ...], Callable]]:
    """Phi-3's checkpoints fuse q, k and v into `self_attn.qkv_proj.weight` [(H + 2K) * d, D] (q's rows, then k's,
    then v's) and gate and up into `mlp.gate_up_proj.weight` [2F, D] (gate's rows, then up's): each of those
    parameters is read from its rows of the fused tensor, so the parameter tree (and tensor parallelism, int8) is
    Llama's. The fused tensor is read once per parameter made from it."""
    d, f = c.hidden_size, c.intermediate_size
    qd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    qkv, gate_up = "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"
    fused = {  # Llama's name -> (the fused tensor, its rows)
        "self_attn.q_proj.weight": (qkv, 0, qd),
        "self_attn.k_proj.weight": (qkv, qd, qd + kd),
        "self_attn.v_proj.weight": (qkv, qd + kd, qd + 2 * kd),
        "mlp.gate_proj.weight": (gate_up, 0, f),
        "mlp.up_proj.weight": (gate_up, f, 2 * f),
    }
    rows = {qkv: qd + 2 * kd, gate_up: 2 * f}
    result = []
    for name, path, shape, convert in specs:
        if name in fused:
            name, start, stop = fused[name]
            shape, convert = (rows[name], d), _rows(start, stop, convert)
        result.append((name, path, shape, convert))
    return result


def moe_block_name(architecture: str) -> str:
    """Where a checkpoint keeps a layer's experts: Mixtral's `block_sparse_moe`, Qwen-MoE's `mlp`."""
    return "block_sparse_moe" if architecture == "mixtral" else "mlp"


def expert_projection_names(architecture: str) -> tuple[str, str, str]:
    """A checkpoint's names of an expert's gate, up and down projections: Mixtral's w1, w3, w2, Qwen-MoE's own."""
    return ("w1", "w3", "w2") if architecture == "mixtral" else ("gate_proj", "up_proj", "down_proj")


def _moe_router_specs(c: ModelConfig) -> list[tuple[str, tuple[str, ...], tuple[int, ...], Callable]]:
    """layer_tensor_specs' entries for a mixture of experts besides the experts (expert_tensor_specs): the router and
    Qwen2-MoE's shared expert with its gate."""
    d, block = c.hidden_size, moe_block_name(c.architecture)
    specs = [(f"{block}.gate.weight", ("mlp", "router", "kernel"), (c.num_experts, d), _linear())]
    s = c.shared_expert_intermediate_size
    if s:
        specs += [
            (
                f"{block}.shared_expert.gate_proj.weight",
                ("mlp", "shared_expert", "gate_proj", "kernel"),
                (s, d),
                _linear(),
            ),
            (f"{block}.shared_expert.up_proj.weight", ("mlp", "shared_expert", "up_proj", "kernel"), (s, d), _linear()),
            (
                f"{block}.shared_expert.down_proj.weight",
                ("mlp", "shared_expert", "down_proj", "kernel"),
                (d, s),
                _linear(),
            ),
            (f"{block}.shared_expert_gate.weight", ("mlp", "shared_expert_gate", "kernel"), (1, d), _linear()),
        ]
    return specs


def expert_tensor_specs(c: ModelConfig) -> list[tuple[str, tuple[str, ...], tuple[int, ...], Callable]]:
    """Each expert projection as layer_tensor_specs gives a layer's tensors, but one checkpoint tensor per expert:
    (name inside `layers.{i}.` with `{j}` for the expert, parameter path under `layers`, torch shape of one expert,
    torch -> jaxpage transform of one expert); the experts are stacked on a leading axis. None for a dense model."""
    if not c.is_moe:
        return []
    d, f, block = c.hidden_size, c.moe_intermediate_size, moe_block_name(c.architecture)
    names = expert_projection_names(c.architecture)
    shapes = ((f, d), (f, d), (d, f))
    return [
        (f"{block}.experts.{{j}}.{name}.weight", ("mlp", "experts", projection, "kernel"), shape, _linear())
        for name, projection, shape in zip(names, ("gate_proj", "up_proj", "down_proj"), shapes, strict=True)
    ]


def contract_axes(path: tuple[str, ...]) -> tuple[int, ...] | None:
    """The input axes of a weight that int8 quantization scales over (one scale per output channel), for one
    layer's tensor in jaxpage's layout; None for a parameter that stays in floats (norms, biases)."""
    if path[-1] == "embedding":
        return (1,)  # [V, D]: a scale per token (the tied LM head's output channels)
    if path[-1] != "kernel" or path[-2] in ("router", "shared_expert_gate"):  # routing stays in floats (moe.py)
        return None
    if len(path) >= 3 and path[-3] == "experts":
        return (1,)  # [E, in, out]: a scale per expert and output channel
    return (0, 1) if path[-2] == "o_proj" else (0,)  # o_proj [H, d, D]; the others [in, out...]


def read_tensor(
    source: TensorSource, available: set[str], name: str, shape: tuple[int, ...] | None, convert: Callable = _same
) -> np.ndarray:
    """Tensor `name` of `source`, converted; ModelLoadError naming the file and the tensor when it is missing,
    unreadable, not floats or not of `shape` (None: as it is, unchecked, for a quantized projection's reader)."""
    if name not in available:
        raise ModelLoadError(f"{source.file_of(name)}: tensor {name!r} is missing")
    try:
        tensor = source.get(name)
    except ModelLoadError:
        raise
    except Exception as e:  # a truncated or corrupt file surfaces here, from whichever reader
        raise ModelLoadError(f"{source.file_of(name)}: cannot read tensor {name!r} ({e})") from None
    if shape is None:
        return tensor
    if tensor.dtype.kind not in "f" and tensor.dtype.name != "bfloat16":
        raise ModelLoadError(f"{source.file_of(name)}: tensor {name!r} has dtype {tensor.dtype}, expected floats")
    if tuple(tensor.shape) != shape:
        raise ModelLoadError(
            f"{source.file_of(name)}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}"
        )
    return convert(tensor)


def params_from_hf_tensors(config: ModelConfig, source: TensorSource, dtype, quantization: str | None = None) -> dict:
    """The parameter tree (numpy arrays of `dtype`) from a checkpoint's tensors; with quantization "int8", every
    projection and the embedding as int8 with a float32 scale per output channel (`scale` beside `kernel` or
    `embedding`), quantized one tensor at a time: the whole model never exists in floats (a pre-quantized
    checkpoint's projections keep their own codes).

    Raises ModelLoadError naming the file and the tensor when one is missing or has the wrong shape.
    """
    c = config
    dtype = np.dtype(dtype)
    available = source.names()
    prefix = "model." if "model.embed_tokens.weight" in available or "embed_tokens.weight" not in available else ""

    def load(name: str, shape: tuple[int, ...] | None, convert: Callable = _same) -> np.ndarray:
        return read_tensor(source, available, name, shape, convert)

    def store(node: dict, path: tuple[str, ...], tensors, num_layers: int | None = None) -> None:
        """Writes `tensors` (one per layer, stacked, when num_layers is given; else one) at node[path[-1]], each
        in `dtype` as it comes, or quantized to int8 with its scale at node["scale"]."""
        axes = contract_axes(path) if quantization == "int8" else None
        stacked: dict[str, np.ndarray] = {}
        for i, tensor in enumerate(tensors):
            if axes is None:
                parts = {path[-1]: tensor}
            else:
                parts = dict(zip((path[-1], "scale"), quantize(tensor, axes), strict=True))
            for key, value in parts.items():
                if key not in stacked:
                    stacked[key] = np.empty((num_layers or 1, *value.shape), value.dtype if axes else dtype)
                stacked[key][i] = value
        for key, value in stacked.items():
            node[key] = value if num_layers else value[0]

    def quantized_projection(module: str, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        """A pre-quantized projection's parameters (jaxpage.models.quantized), read by its checkpoint's format."""
        tensor = functools.partial(load, shape=None)  # its reader checks each tensor's shape and dtype
        return read_projection(c.weight_quantization, tensor, available.__contains__, module, shape, source.file_of)

    def layer_tensor(i: int, suffix: str, shape: tuple[int, ...], convert: Callable) -> np.ndarray:
        """Layer i's tensor; for an expert projection (`{j}` in the name), every expert's, stacked."""
        if "{j}" not in suffix:
            return load(f"{prefix}layers.{i}.{suffix}", shape, convert)
        return np.stack(
            [load(f"{prefix}layers.{i}.{suffix.format(j=j)}", shape, convert) for j in range(c.num_experts)]
        )

    layers: dict = {}
    for suffix, path, shape, convert in [*layer_tensor_specs(c), *expert_tensor_specs(c)]:
        node = layers
        for key in path[:-1]:
            node = node.setdefault(key, {})
        module = suffix.removesuffix(".weight")
        if c.weight_quantization is not None and module in c.weight_quantization.quantized:
            parts = [quantized_projection(f"{prefix}layers.{i}.{module}", shape) for i in range(c.num_layers)]
            node.update({key: np.stack([p[key] for p in parts]) for key in parts[0]})
            continue
        # Each layer read once and written straight into the stacked array.
        tensors = (layer_tensor(i, suffix, shape, convert) for i in range(c.num_layers))
        store(node, path, tensors, c.num_layers)

    params: dict = {"embed_tokens": {}, "layers": layers, "norm": {}}
    embedding = load(f"{prefix}embed_tokens.weight", (c.vocab_size, c.hidden_size))
    store(params["embed_tokens"], ("embed_tokens", "embedding"), [embedding])
    store(params["norm"], ("norm", "scale"), [load(f"{prefix}norm.weight", (c.hidden_size,))])
    if not c.tie_word_embeddings:
        params["lm_head"] = {}
        if c.weight_quantization is not None and "lm_head" in c.weight_quantization.quantized:
            params["lm_head"] = quantized_projection("lm_head", (c.vocab_size, c.hidden_size))
        else:
            lm_head = load("lm_head.weight", (c.vocab_size, c.hidden_size), _linear())
            store(params["lm_head"], ("lm_head", "kernel"), [lm_head])
    return params
