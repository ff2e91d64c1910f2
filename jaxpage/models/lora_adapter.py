"""Reads a LoRA adapter as Hugging Face PEFT saves it (`adapter_config.json` + `adapter_model.safetensors`), without
torch, and checks it against the base model's config.

PEFT stores, per adapted projection of layer i,
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]
(torch's Linear layout), and computes `lora_B(lora_A(x)) * scaling`. Anything that changes that computation (DoRA,
biases, per-module ranks, extra trained modules, ...) is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import NoReturn

import numpy as np

from jaxpage.config import ModelConfig
from jaxpage.errors import ModelLoadError
from jaxpage.models.hf_loader import open_safetensors
from jaxpage.validation import INT32_MAX, check_number, describe, is_int

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ALL_LINEAR = "all-linear"  # PEFT's shorthand for every Linear but the LM head
# adapter_config.json fields that change what an adapter computes, which jaxpage does not implement: refused when set
UNSUPPORTED = {
    "use_dora": "DoRA",
    "rank_pattern": "a rank per module",
    "alpha_pattern": "an alpha per module",
    "fan_in_fan_out": "weights in Conv1D's transposed layout",
    "lora_bias": "a bias on lora_B",
    "layer_replication": "replicated layers",
    "target_parameters": "adapters of parameters (as of fused experts)",
    "trainable_token_indices": "trained token embeddings",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QA-LoRA",
}
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.([0-9]+)\.(\w+)\.(\w+)\.lora_([AB])\.weight")


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights, read and checked: the delta of module m on input x [..., in] in layer i is
    `(x @ a[i]) @ b[i]`, PEFT's `lora_B(lora_A(x)) * scaling` in eval mode."""

    name: str  # for messages
    rank: int  # r
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    # target module -> (a [L, in, r], b [L, r, out]) float32, in/out as torch's Linear (heads flattened), b already
    # multiplied by scaling; zeros in the layers the adapter does not touch. Only the modules it targets are present.
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


def module_features(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) of a projection as torch's Linear has them."""
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    features = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d)}
    return (features | {"gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)})[module]


def module_key(layer: int, module: str) -> str:
    """The module's name in the transformers model, as PEFT matches target_modules against it."""
    return f"model.layers.{layer}.{PARENTS[module]}.{module}"


def tensor_name(layer: int, module: str, factor: str) -> str:
    """The name PEFT saves lora_A (factor "A") or lora_B ("B") of a module under."""
    return f"base_model.model.{module_key(layer, module)}.lora_{factor}.weight"


def read_lora_adapter(path, config: ModelConfig, name: str | None = None, max_rank: int | None = None) -> LoRAAdapter:
    """The adapter PEFT saved in directory `path`, for the base model `config` (name: for messages; default the
    directory's name). ModelLoadError, naming the adapter, its path and the problem, for anything jaxpage cannot run
    exactly as PEFT would, and for an adapter of another base model (a layer or a shape the config does not have).
    max_rank: the largest rank allowed (vLLM's max_lora_rank)."""
    directory = Path(path)
    name = name or directory.name

    def refuse(problem: str) -> NoReturn:
        raise ModelLoadError(f"LoRA adapter {name!r} ({directory}): {problem}")

    settings = _read_settings(directory, refuse)
    rank, alpha = settings.get("r", 8), settings.get("lora_alpha", 8)  # PEFT's defaults
    if not is_int(rank) or rank < 1:
        refuse(f"r must be an integer >= 1, got {describe(rank)}")
    if rank > INT32_MAX:
        refuse(f"r must be at most {INT32_MAX}, got {describe(rank)}")
    if max_rank is not None and rank > max_rank:
        refuse(f"rank {rank} is larger than max_lora_rank {max_rank}")
    try:
        alpha = check_number("lora_alpha", alpha, "a number", lambda x: True)
    except ValueError as e:
        refuse(str(e))
    rslora = settings.get("use_rslora")
    if rslora is not None and not isinstance(rslora, bool):
        refuse(f"use_rslora must be true or false, got {describe(rslora)}")
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    targeted = _targeted(settings, config, refuse)

    tensors = _read_tensors(directory / WEIGHTS_FILE, refuse)
    for tensor, (layer, module) in sorted(_parse_names(tensors, config, refuse).items()):
        if (layer, module) not in targeted:
            refuse(f"{WEIGHTS_FILE} holds {describe(tensor, 200)}, a module {CONFIG_FILE} does not target")
    weights = {}
    for module in [m for m in LORA_TARGETS if any(t == m for _, t in targeted)]:
        n_in, n_out = module_features(config, module)
        # Every shape checked before the stacks are made: r bounds their size, the file's tensors bound r.
        factors = {
            layer: (_tensor(tensors, layer, module, "A", (rank, n_in), refuse),
                    _tensor(tensors, layer, module, "B", (n_out, rank), refuse))
            for layer in sorted(layer for layer, m in targeted if m == module)
        }  # fmt: skip
        a = np.zeros((config.num_layers, n_in, rank), np.float32)
        b = np.zeros((config.num_layers, rank, n_out), np.float32)
        for layer, (lora_a, lora_b) in factors.items():
            a[layer], b[layer] = lora_a.T, lora_b.T
        weights[module] = (a, b * np.float32(scaling))
    return LoRAAdapter(name=name, rank=rank, scaling=scaling, weights=weights)


def _tensor(tensors: dict, layer: int, module: str, factor: str, shape: tuple[int, int], refuse) -> np.ndarray:
    """lora_A ([r, in]) or lora_B ([out, r]) of a targeted module, checked against the base model's shape."""
    tensor = tensor_name(layer, module, factor)
    if tensor not in tensors:
        refuse(f"no tensor {tensor!r} in {WEIGHTS_FILE}, though {CONFIG_FILE} targets {module} of layer {layer}")
    if tensors[tensor].shape != shape:
        got = list(tensors[tensor].shape)
        refuse(f"tensor {tensor!r} has shape {got}, expected {list(shape)} from r and the base model's {module} "
               "(an adapter of another base model?)")  # fmt: skip
    return tensors[tensor]


def _read_settings(directory: Path, refuse) -> dict:
    """adapter_config.json, refused unless it describes a plain LoRA adapter."""
    if not directory.is_dir():
        refuse("no such directory")
    if not (directory / CONFIG_FILE).is_file():
        refuse(f"no {CONFIG_FILE}; not a PEFT adapter directory")
    if not (directory / WEIGHTS_FILE).is_file():
        pickled = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
        hint = f" ({', '.join(pickled)} are pickled PyTorch files, which jaxpage never unpickles)" if pickled else ""
        refuse(f"no {WEIGHTS_FILE}{hint}; save the adapter with safetensors (PEFT's default)")
    try:
        settings = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        refuse(f"{CONFIG_FILE} is not readable JSON ({type(e).__name__}: {e})")
    if not isinstance(settings, dict):
        refuse(f"{CONFIG_FILE} must hold a JSON object, got {describe(settings)}")
    if settings.get("peft_type") != "LORA":
        refuse(
            f"peft_type is {describe(settings.get('peft_type'))}; jaxpage reads only LoRA adapters (peft_type 'LORA')"
        )
    for key, feature in UNSUPPORTED.items():
        if settings.get(key):
            refuse(f"{key} is {_json_text(settings[key])}: jaxpage does not support {feature}")
    if settings.get("modules_to_save"):
        refuse(f"modules_to_save {describe(settings['modules_to_save'])}: fully trained copies of modules are not "
               "supported")  # fmt: skip
    if settings.get("bias") not in (None, "none"):
        refuse(f"bias {describe(settings['bias'])}: trained biases are not supported (only bias 'none')")
    if settings.get("layers_pattern") not in (None, "", [], "layers", ["layers"]):
        refuse(f"layers_pattern {describe(settings['layers_pattern'])}: jaxpage's models number their layers in "
               "'layers'")  # fmt: skip
    return settings


def _json_text(value) -> str:
    """`value` as JSON spells it, cut to 80 characters."""
    text = json.dumps(value)
    return text if len(text) <= 80 else f"{text[:75]}...{text[-2:]}"


def _targeted(settings: dict, config: ModelConfig, refuse) -> set[tuple[int, str]]:
    """The (layer, module) pairs PEFT adapts: target_modules (a list of names matched as suffixes, "all-linear", or a
    regex matched whole), less exclude_modules, in layers_to_transform (a list of target names only)."""
    targets, layers = settings.get("target_modules"), settings.get("layers_to_transform")
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        targets = list(LORA_TARGETS)
    if isinstance(targets, str):
        if layers is not None:
            refuse("layers_to_transform cannot be used with a regular expression as target_modules (as in PEFT)")
    elif isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        for target in targets:
            if target.rsplit(".", 1)[-1] not in LORA_TARGETS:
                refuse(f"target module {describe(target)} is not supported; jaxpage adapts {', '.join(LORA_TARGETS)}")
    else:
        refuse(f"target_modules must be a list of module names or a regular expression, got {describe(targets)}")
    if layers is None or layers == []:
        layers = list(range(config.num_layers))
    layers = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        refuse(f"layers_to_transform must be a layer index or a list of them, got {describe(layers)}")
    if beyond := [i for i in layers if not 0 <= i < config.num_layers]:
        refuse(f"layers_to_transform names layers {describe(beyond)}; the base model has {config.num_layers} layers")
    exclude = settings.get("exclude_modules")
    if not (
        exclude is None
        or isinstance(exclude, str)
        or (isinstance(exclude, list) and all(isinstance(e, str) for e in exclude))
    ):
        refuse(f"exclude_modules must be a list of module names or a regular expression, got {describe(exclude)}")
    try:
        targeted = {
            (layer, module)
            for layer in layers
            for module in LORA_TARGETS
            if _matches(targets, module_key(layer, module)) and not _matches(exclude, module_key(layer, module))
        }
    except (re.error, OverflowError, RecursionError) as e:  # a bad pattern; a repeat or nesting too large for re
        refuse(f"target_modules or exclude_modules is not a valid regular expression ({e})")
    if config.is_moe and (mlp := [m for m in LORA_TARGETS if PARENTS[m] == "mlp" and any(t == m for _, t in targeted)]):
        refuse(f"targets the MLP's {', '.join(mlp)} of a mixture-of-experts model; only its attention can be adapted")
    if not targeted:
        refuse(f"target_modules {describe(targets)} matches none of {', '.join(LORA_TARGETS)}")
    return targeted


def _matches(patterns, key: str) -> bool:
    """PEFT's match of a module name: a str is a regex matched whole, a list of names each matched as a suffix."""
    if not patterns:
        return False
    if isinstance(patterns, str):
        return re.fullmatch(patterns, key) is not None
    return any(key == p or key.endswith(f".{p}") for p in patterns)


def _read_tensors(path: Path, refuse) -> dict[str, np.ndarray]:
    """Every tensor of the file as float32 (bfloat16 and float16 too)."""
    try:
        handle = open_safetensors(path)
    except ModelLoadError as e:  # truncated or malformed: its message names the file
        refuse(str(e))
    with handle as f:
        try:
            return {tensor: np.asarray(f.get_tensor(tensor), np.float32) for tensor in f.keys()}
        except Exception as e:  # the header was checked: a read error of the file itself, from safetensors
            refuse(f"{path}: cannot read its tensors ({type(e).__name__}: {e})")


def _parse_names(tensors: dict, config: ModelConfig, refuse) -> dict[str, tuple[int, str]]:
    """tensor name -> (layer, module); refused for a name PEFT would not write for a supported module."""
    parsed = {}
    for tensor in tensors:
        match = _TENSOR.fullmatch(tensor)
        if match is None or PARENTS.get(match[3]) != match[2]:
            refuse(f"unexpected tensor {describe(tensor, 200)} in {WEIGHTS_FILE}; jaxpage reads only lora_A and "
                   f"lora_B weights of {', '.join(LORA_TARGETS)} in model.layers")  # fmt: skip
        if int(match[1]) >= config.num_layers:
            refuse(
                f"tensor {describe(tensor, 200)} is of layer {match[1]}; the base model has {config.num_layers} layers"
            )
        parsed[tensor] = (int(match[1]), match[3])
    return parsed
