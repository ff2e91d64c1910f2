"""Model config readers: ModelConfig from a Hugging Face config dict (transformers 4 or 5 layout), which GGUF metadata
is also written as (jaxpage.models.gguf_loader). Every field is checked as it is read: an unsupported architecture
or option, or a missing, mistyped or out-of-range number, raises ModelLoadError naming the source and the field."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from jaxpage.config.model import (
    GEMMA_ARCHITECTURES,
    LAYER_TYPES,
    MOE_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    RopeScaling,
)
from jaxpage.config.weight_quantization import LM_HEAD, WeightQuantization, weight_quantization_from_hf
from jaxpage.errors import ModelLoadError
from jaxpage.validation import INT32_MAX, check_number, describe, is_int

DEFAULT_EXPERTS_PER_TOKEN = {"mixtral": 2, "qwen2_moe": 4, "qwen3_moe": 8}  # transformers' config classes' defaults
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
PHI3_ROPE_TYPES = ("default", "longrope")  # what transformers' Phi3Config accepts (its "su" and "yarn" are longrope)


def model_config_from_hf(
    hf: dict[str, Any], source: str = "config.json", names: dict[str, str] | None = None
) -> ModelConfig:
    """The model's config from a Hugging Face config dict (transformers 4 or 5 layout).

    Raises ModelLoadError naming `source` and the field for architectures and options jaxpage does not support and
    for a missing, mistyped or out-of-range number. `names`: how the source calls a field, by its HF name (a GGUF
    file's metadata keys), for those messages.
    """
    names = names or {}

    def name(key: str) -> str:
        return names.get(key, key)

    arch = hf.get("model_type")
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: model_type {describe(arch)} is not supported; jaxpage runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    weight_quantization = weight_quantization_from_hf(hf, source)
    if arch not in GEMMA_ARCHITECTURES and hf.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act {describe(hf['hidden_act'])} is not supported (only 'silu')")
    try:
        if _flag(name("use_sliding_window"), hf.get("use_sliding_window"), False):
            raise ModelLoadError(f"per-layer sliding windows ({arch} use_sliding_window) are not supported")
        _refuse_unsupported_moe_options(hf, arch)
        sizes = _sizes_from_hf(hf, name)
        rope_theta, rope_scaling = _rope_from_hf(hf, name)
        gemma = _gemma_from_hf(hf, arch, name, sizes["num_layers"])
        if "rope_theta" in gemma:  # Gemma 3's global layers' RoPE, from its per-layer-type parameters
            rope_theta, rope_scaling = gemma.pop("rope_theta"), gemma.pop("rope_scaling")
        window = hf.get("sliding_window", 4096 if arch in GEMMA_ARCHITECTURES else None)  # HF's defaults
        window = window if arch in ("mistral", "mixtral", "phi3", *GEMMA_ARCHITECTURES) else None
        attention_bias = _flag(name("attention_bias"), hf.get("attention_bias"), False)
        tie_default = arch in GEMMA_ARCHITECTURES
        config = ModelConfig(
            architecture=arch,
            **sizes,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=_flag(name("tie_word_embeddings"), hf.get("tie_word_embeddings"), tie_default),
            qkv_bias=_qkv_bias(hf, arch, attention_bias, name),
            o_bias=attention_bias and arch in ("llama", *GEMMA_ARCHITECTURES),
            mlp_bias=_flag(name("mlp_bias"), hf.get("mlp_bias"), False) and arch == "llama",
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3_text"),
            **_moe_from_hf(hf, arch, name),
            partial_rotary_factor=_partial_rotary_from_hf(hf, arch, name, sizes["head_dim"], rope_scaling),
            **gemma,
            sliding_window=None if window is None else _size(name("sliding_window"), window),
            bos_token_id=None
            if hf.get("bos_token_id") is None
            else _token_id(name("bos_token_id"), hf["bos_token_id"]),
            eos_token_ids=_eos_token_ids(name("eos_token_id"), hf.get("eos_token_id")),
        )
        return _with_weight_quantization(config, weight_quantization)
    except ModelLoadError as e:
        raise ModelLoadError(f"{source}: {e}") from None
    except KeyError as e:
        raise ModelLoadError(f"{source}: required field {name(e.args[0])!r} is missing") from None
    except (AssertionError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: inconsistent model config ({e})") from None


def _with_weight_quantization(config: ModelConfig, scheme: WeightQuantization | None) -> ModelConfig:
    """`config` with a pre-quantized checkpoint's scheme; a tied LM head is the embedding's floats (quantized LM heads
    are untied ones). ModelLoadError for the families whose quantized weights jaxpage does not read yet."""
    if scheme is None:
        return config
    if config.is_moe:
        raise ModelLoadError(f"quantization_config: a quantized mixture of experts ({config.architecture}) is not "
                             "supported yet; load its unquantized weights")  # fmt: skip
    if config.architecture == "phi3":
        raise ModelLoadError("quantization_config: quantized Phi-3 checkpoints (fused qkv_proj) are not supported yet")
    if config.tie_word_embeddings:
        scheme = dataclasses.replace(scheme, quantized=scheme.quantized - {LM_HEAD})
    return dataclasses.replace(config, weight_quantization=scheme)


def _flag(field: str, value, default: bool) -> bool:
    """A true/false option; absent or null: `default`."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelLoadError(f"{field} must be true or false, got {describe(value)}")
    return value


def _token_id(field: str, value) -> int:
    if not is_int(value) or not 0 <= value <= INT32_MAX:
        raise ModelLoadError(f"{field} must be a token id (an integer in [0, {INT32_MAX}]), got {describe(value)}")
    return int(value)


def _eos_token_ids(field: str, value) -> tuple[int, ...]:
    """eos_token_id: absent or null, one token id, or a list of them."""
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(_token_id(f"{field}[{i}]", token) for i, token in enumerate(value))
    return (_token_id(field, value),)


def _qkv_bias(hf: dict[str, Any], arch: str, attention_bias: bool, name: Callable[[str], str]) -> bool:
    """Whether q, k and v have biases: always in Qwen2, in Qwen2-MoE unless qkv_bias says not, where attention_bias
    says so in Llama, Qwen3 and Qwen3-MoE."""
    if arch == "qwen2":
        return True
    if arch == "qwen2_moe":
        return _flag(name("qkv_bias"), hf.get("qkv_bias"), True)
    return attention_bias and arch in ("llama", "qwen3", "qwen3_moe", *GEMMA_ARCHITECTURES)


def _optional_positive(field: str, value) -> float | None:
    return None if value is None else _positive(field, value)


def _gemma_layer_types(hf: dict[str, Any], arch: str, name: Callable[[str], str], num_layers: int) -> tuple[str, ...]:
    """Each layer's attention: transformers 5's layer_types, else the families' patterns (Gemma 2: sliding on even
    layers; Gemma 3: every sliding_window_pattern-th layer full, the others sliding)."""
    types = hf.get("layer_types")
    if types is None:
        if arch == "gemma2":
            return tuple(LAYER_TYPES[i % 2 == 0] for i in range(num_layers))
        key = "sliding_window_pattern" if "sliding_window_pattern" in hf else "_sliding_window_pattern"
        pattern = _size(name(key), hf.get(key, 6))
        return tuple(LAYER_TYPES[(i + 1) % pattern != 0] for i in range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers or not all(t in LAYER_TYPES for t in types):
        raise ModelLoadError(
            f"{name('layer_types')} must be a list of {num_layers} of {', '.join(map(repr, LAYER_TYPES))}, "
            f"got {describe(types)}"
        )
    return tuple(types)


def _gemma3_rope(hf: dict[str, Any], name: Callable[[str], str]) -> dict[str, Any]:
    """Gemma 3's RoPE: the global layers' base and scaling, and the sliding layers' base (unscaled). transformers 5
    writes rope_parameters per layer type; checkpoints on the hub rope_theta, rope_scaling and rope_local_base_freq."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        local = params.get("sliding_attention") or {}
        if not isinstance(local, dict) or local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"{name('rope_parameters.sliding_attention')} must be unscaled, got {describe(local)}")

        def renamed(key: str) -> str:
            return name(key.replace("rope_parameters", "rope_parameters.full_attention", 1))

        theta, scaling = _rope_from_hf({"rope_parameters": params["full_attention"]}, renamed)
        local_theta = _positive(name("rope_parameters.sliding_attention.rope_theta"), local.get("rope_theta", 10000.0))
    else:
        theta, scaling = _rope_from_hf(hf, name)
        local_theta = _positive(name("rope_local_base_freq"), hf.get("rope_local_base_freq", 10000.0))
    return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta)


def _gemma_from_hf(hf: dict[str, Any], arch: str, name: Callable[[str], str], num_layers: int) -> dict[str, Any]:
    """ModelConfig's Gemma 2 / Gemma 3 fields (none for the other families)."""
    if arch not in GEMMA_ARCHITECTURES:
        return {}
    key = "hidden_activation" if hf.get("hidden_activation") is not None else "hidden_act"
    act = hf.get(key, "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{name(key)} {describe(act)} is not supported (only 'gelu_pytorch_tanh')")
    if _flag(name("use_bidirectional_attention"), hf.get("use_bidirectional_attention"), False):
        raise ModelLoadError(f"{name('use_bidirectional_attention')} true is not supported (only causal attention)")
    # transformers' defaults when absent: Gemma 2 caps (50 and 30), Gemma 3 does not
    attn_cap = hf.get("attn_logit_softcapping", 50.0 if arch == "gemma2" else None)
    final_cap = hf.get("final_logit_softcapping", 30.0 if arch == "gemma2" else None)
    fields = dict(
        hidden_act="gelu_pytorch_tanh",
        norm_weight_offset=1.0,
        embedding_multiplier=float(_size(name("hidden_size"), hf["hidden_size"])) ** 0.5,
        query_pre_attn_scalar=_positive(name("query_pre_attn_scalar"), hf.get("query_pre_attn_scalar", 256)),
        attn_logit_softcapping=_optional_positive(name("attn_logit_softcapping"), attn_cap),
        final_logit_softcapping=_optional_positive(name("final_logit_softcapping"), final_cap),
        sandwich_norms=True,
        layer_types=_gemma_layer_types(hf, arch, name, num_layers),
    )
    if "sliding_attention" in fields["layer_types"] and "sliding_window" in hf and hf["sliding_window"] is None:
        raise ModelLoadError(
            f"{name('sliding_window')} must be a positive integer (the model has sliding layers), got None"
        )
    return fields | (_gemma3_rope(hf, name) if arch == "gemma3_text" else {})


def _refuse_unsupported_moe_options(hf: dict[str, Any], arch: str) -> None:
    """ModelLoadError naming the Qwen MoE options that make some layers dense: jaxpage scans one layer body, so every
    layer of a MoE model must be sparse."""
    if arch not in ("qwen2_moe", "qwen3_moe"):
        return
    step = hf.get("decoder_sparse_step", 1)
    if step != 1:
        raise ModelLoadError(f"decoder_sparse_step {describe(step)} is not supported (only 1: every layer sparse)")
    dense_layers = hf.get("mlp_only_layers")
    if dense_layers not in (None, []):
        raise ModelLoadError(f"mlp_only_layers {describe(dense_layers)} is not supported (only []: no dense layer)")


def _moe_from_hf(hf: dict[str, Any], arch: str, name: Callable[[str], str]) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from a Mixtral, Qwen2-MoE or Qwen3-MoE config (none for the dense
    families). Mixtral's experts have intermediate_size features and always renormalize their weights."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    # Mixtral's key, and transformers 5's for Qwen3-MoE; Qwen's checkpoints write num_experts.
    experts_key = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
    num_experts = _size(name(experts_key), hf[experts_key])
    top_k = _size(name("num_experts_per_tok"), hf.get("num_experts_per_tok", DEFAULT_EXPERTS_PER_TOKEN[arch]))
    if top_k > num_experts:
        raise ModelLoadError(
            f"{name('num_experts_per_tok')} must be at most {name(experts_key)} ({num_experts}), got {top_k}"
        )
    if arch == "mixtral":
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=_size(name("intermediate_size"), hf["intermediate_size"]),
            norm_topk_prob=True,
        )
    norm_topk_prob = hf.get("norm_topk_prob", False)
    if not isinstance(norm_topk_prob, bool):
        raise ModelLoadError(f"{name('norm_topk_prob')} must be true or false, got {describe(norm_topk_prob)}")
    shared = hf.get("shared_expert_intermediate_size") if arch == "qwen2_moe" else None
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=_size(name("moe_intermediate_size"), hf["moe_intermediate_size"]),
        shared_expert_intermediate_size=0
        if shared in (None, 0)
        else _size(name("shared_expert_intermediate_size"), shared),
        norm_topk_prob=norm_topk_prob,
    )


def _size(field: str, value) -> int:
    """A count or dimension of the model: a positive integer that fits the steps' int32 arrays."""
    if not is_int(value) or value <= 0:
        raise ModelLoadError(f"{field} must be a positive integer, got {describe(value)}")
    if value > INT32_MAX:
        raise ModelLoadError(f"{field} must be an integer <= {INT32_MAX}, got {describe(value)}")
    return int(value)


def _positive(field: str, value) -> float:
    """A positive finite number (an epsilon, a RoPE base or factor)."""
    try:
        return check_number(field, value, "a positive finite number", lambda x: x > 0)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None


def _sizes_from_hf(hf: dict[str, Any], name: Callable[[str], str]) -> dict[str, Any]:
    """ModelConfig's dimensions, counts and epsilon, each checked (a zero head count would otherwise divide by zero
    deep in the load). A required field absent raises KeyError; an optional one absent or null takes HF's default."""

    def size(key: str, required: bool = True) -> int | None:
        value = hf[key] if required else hf.get(key)
        return None if value is None and not required else _size(name(key), value)

    hidden, heads = size("hidden_size"), size("num_attention_heads")
    kv_heads = size("num_key_value_heads", required=False) or heads  # HF: absent means one KV head per query head
    if heads % kv_heads:
        kv_field = name("num_key_value_heads")
        raise ModelLoadError(f"{name('num_attention_heads')} must be divisible by {kv_field} ({kv_heads}), got {heads}")
    head_dim = size("head_dim", required=False)
    head_dim_field = name("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ModelLoadError(
                f"{name('hidden_size')} must be divisible by {name('num_attention_heads')} ({heads}) when "
                f"{name('head_dim')} is not given, got {hidden}"
            )
        head_dim = hidden // heads
        head_dim_field = f"{name('head_dim')} ({name('hidden_size')} / {name('num_attention_heads')})"
    if head_dim % 2:
        raise ModelLoadError(f"{head_dim_field} must be even (RoPE rotates pairs of dimensions), got {head_dim}")
    eps = hf.get("rms_norm_eps")
    max_len = size("max_position_embeddings", required=False)
    return dict(
        vocab_size=size("vocab_size"),
        hidden_size=hidden,
        intermediate_size=size("intermediate_size"),
        num_layers=size("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6 if eps is None else _positive(name("rms_norm_eps"), eps),
        max_position_embeddings=4096 if max_len is None else max_len,
    )


def _rope_from_hf(hf: dict[str, Any], name: Callable[[str], str]) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters`; older configs (and most on the hub) `rope_theta` + `rope_scaling`.
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = hf.get(key) or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"{name(key)} must be an object, got {describe(params)}")

    def number(param: str, default: float | None = None) -> float:
        if param not in params and default is None:
            raise ModelLoadError(f"required field {name(f'{key}.{param}')!r} is missing")
        return _positive(name(f"{key}.{param}"), params.get(param, default))

    if params.get("rope_theta") is not None:
        theta = number("rope_theta")
    else:
        theta = 10000.0 if hf.get("rope_theta") is None else _positive(name("rope_theta"), hf["rope_theta"])
    rope_type = params.get("rope_type", params.get("type", "default"))
    if hf.get("model_type") == "phi3":
        rope_type = _phi3_rope_type(rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"RoPE type {describe(rope_type)} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=number("factor"))
    if rope_type == "longrope":
        return theta, _longrope_from_hf(hf, params, key, name, number)
    low, high = number("low_freq_factor", 1.0), number("high_freq_factor", 4.0)
    if high <= low:  # Llama 3 interpolates between the two wavelengths: equal ones divide by zero
        raise ModelLoadError(
            f"{name(f'{key}.high_freq_factor')} must be greater than {name(f'{key}.low_freq_factor')} ({low}), "
            f"got {high}"
        )
    original = params.get("original_max_position_embeddings", 8192)
    return theta, RopeScaling(
        "llama3",
        factor=number("factor"),
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=_size(name(f"{key}.original_max_position_embeddings"), original),
    )


# ----- Phi-3 (Phi-3, Phi-3.5, Phi-4-mini): LongRoPE and the partial rotary factor -----

PHI3_ORIGINAL_MAX_POSITION_EMBEDDINGS = 4096  # transformers' Phi3Config's default


def _phi3_rope_type(rope_type) -> str:
    """Phi-3's RoPE type as transformers' Phi3Config reads it: the "su" and "yarn" of older checkpoints are longrope,
    and a type other than default and longrope is refused."""
    rope_type = "longrope" if rope_type in ("su", "yarn") else rope_type
    if rope_type not in PHI3_ROPE_TYPES:
        raise ModelLoadError(
            f"RoPE type {describe(rope_type)} is not supported for phi3 (supported: {', '.join(PHI3_ROPE_TYPES)})"
        )
    return rope_type


def _rope_factors(params: dict[str, Any], param: str, field: str) -> tuple[float, ...]:
    """LongRoPE's short_factor or long_factor (`param`; `field`: its name for messages): positive numbers."""
    if param not in params:
        raise ModelLoadError(f"required field {field!r} is missing")
    values = params[param]
    if not isinstance(values, list | tuple) or not values:
        raise ModelLoadError(f"{field} must be a list of positive numbers, got {describe(values)}")
    return tuple(_positive(f"{field}[{i}]", value) for i, value in enumerate(values))


def _longrope_from_hf(
    hf: dict[str, Any], params: dict[str, Any], key: str, name: Callable[[str], str], number: Callable
) -> RopeScaling:
    """LongRoPE's scaling as transformers' _compute_longrope_parameters reads it (`params`: hf[key]).

    original_max_position_embeddings: the top level's where the config has one, which transformers prefers to
    rope_scaling's (for phi3 always: Phi3Config's default is 4096), else rope_scaling's, else max_position_embeddings.
    factor: rope_scaling's, else max_position_embeddings / original_max_position_embeddings. attention_factor:
    rope_scaling's, else sqrt(1 + ln(factor) / ln(original_max_position_embeddings)), 1 for a factor up to 1. The
    factors' lengths are checked against the rotary dim by _partial_rotary_from_hf.
    """
    max_len = hf.get("max_position_embeddings") or 4096  # checked by _sizes_from_hf; its default
    top = hf.get("original_max_position_embeddings")
    if top is None and hf.get("model_type") == "phi3":
        top = PHI3_ORIGINAL_MAX_POSITION_EMBEDDINGS
    if top is not None:
        field = name("original_max_position_embeddings")
        original = _size(field, top)
    else:
        field = name(f"{key}.original_max_position_embeddings")
        original = _size(field, params.get("original_max_position_embeddings", max_len))
    factor = number("factor") if params.get("factor") is not None else max_len / original
    if params.get("attention_factor") is not None:
        attention_factor = number("attention_factor")
    elif factor <= 1:
        attention_factor = 1.0
    elif original < 2:  # the default attention factor divides by its logarithm
        raise ModelLoadError(f"{field} must be at least 2 for LongRoPE's attention factor, got {original}")
    else:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        "longrope",
        factor=factor,
        original_max_position_embeddings=original,
        short_factor=_rope_factors(params, "short_factor", name(f"{key}.short_factor")),
        long_factor=_rope_factors(params, "long_factor", name(f"{key}.long_factor")),
        attention_factor=attention_factor,
    )


def _partial_rotary_from_hf(
    hf: dict[str, Any], arch: str, name: Callable[[str], str], head_dim: int, rope_scaling: RopeScaling | None
) -> float:
    """ModelConfig.partial_rotary_factor: Phi-3's, as transformers' Phi3Config reads it (rope_parameters', else the
    top level's, as Phi-4-mini's config.json has it; else 1), in (0, 1] and giving an even rotary dim; 1 for the
    other families (transformers' Llama rotates whole heads whatever the field says). LongRoPE's factors are checked
    here to have one value per rotated pair of dimensions."""
    factor, field = 1.0, name("partial_rotary_factor")
    if arch == "phi3":
        params = hf.get("rope_parameters")
        value = hf.get("partial_rotary_factor", 1.0)
        if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
            value, field = params["partial_rotary_factor"], name("rope_parameters.partial_rotary_factor")
        try:
            factor = check_number(field, 1.0 if value is None else value, "a number in (0, 1]", lambda x: 0 < x <= 1)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        rotary = int(head_dim * factor)
        if rotary <= 0 or rotary % 2:
            raise ModelLoadError(
                f"{field} must make the rotary dim int(head_dim * {field}) even and positive (head_dim {head_dim}), "
                f"got {describe(value)} (rotary dim {rotary})"
            )
    if rope_scaling is not None and rope_scaling.rope_type == "longrope":
        key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
        pairs = int(head_dim * factor) // 2
        for param in ("short_factor", "long_factor"):
            got = len(getattr(rope_scaling, param))
            if got != pairs:
                raise ModelLoadError(f"{name(f'{key}.{param}')} must have {pairs} values (rotary dim / 2), got {got}")
    return factor
