"""ModelConfig: the frozen, hashable description of a Llama-family model.

Built from a Hugging Face `config.json` (`ModelConfig.from_hf_config`) or from GGUF metadata
(`jaxpage.models.gguf_loader`). Hashable so it can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

from jaxpage.errors import ModelLoadError
from jaxpage.spec_decode.config import SpeculativeConfig
from jaxpage.validation import INT32_MAX, check_bool, check_int, check_number, check_path, describe, fail, is_int

SUPPORTED_ARCHITECTURES = (
    "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3_text", "phi3",
)  # fmt: skip
GEMMA_ARCHITECTURES = ("gemma2", "gemma3_text")
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names of a layer's attention
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # the MLP's activation: Llama's SiLU, Gemma's tanh-approximated GELU
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
DEFAULT_EXPERTS_PER_TOKEN = {"mixtral": 2, "qwen2_moe": 4, "qwen3_moe": 8}  # transformers' config classes' defaults
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
PHI3_ROPE_TYPES = ("default", "longrope")  # what transformers' Phi3Config accepts (its "su" and "yarn" are longrope)
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's fp8 is e4m3

# The one list of each engine argument's choices (EngineConfig checks them, the CLI offers them).
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8",)
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
ATTENTION_IMPLS = ("auto", "xla", "pallas", "pallas_tpu", "pallas_gpu", "pallas_tpu_interpret", "pallas_gpu_interpret")
LOAD_FORMATS = ("auto", "dummy")


def canonical_kv_cache_dtype(name: str) -> str:
    """kv_cache_dtype in its one name per format ("fp8" -> "fp8_e4m3")."""
    return KV_CACHE_DTYPE_ALIASES.get(name, name)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, in the names of HF's `rope_parameters` / `rope_scaling`."""

    rope_type: str  # "linear", "llama3" or "longrope"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 and longrope
    # LongRoPE (Phi-3, Phi-3.5, Phi-4-mini; jaxpage.models.rope.rope_tables): frequency i divided by short_factor[i] at
    # positions below original_max_position_embeddings and by long_factor[i] from it on, cos and sin multiplied by
    # attention_factor. One value per rotated pair of dimensions (ModelConfig.rotary_dim // 2).
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def __post_init__(self):
        assert self.rope_type in ("linear", "llama3", "longrope"), self.rope_type
        assert self.factor > 0, self.factor
        for name in ("short_factor", "long_factor"):  # tuples, also when read back from JSON lists: hashable
            object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))
        if self.rope_type == "longrope":
            assert self.short_factor and self.long_factor, self  # their lengths: ModelConfig's rotary_dim // 2
            assert self.attention_factor > 0, self.attention_factor


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: RopeScaling | None = None
    # llama.cpp's form of Llama 3 RoPE scaling (GGUF tensor rope_freqs): frequency i is divided by factor i.
    rope_freq_factors: tuple[float, ...] | None = None
    # Phi-3 (Phi-4-mini: 0.75): RoPE rotates the first rotary_dim = int(head_dim * partial_rotary_factor) dimensions of
    # each head (rotate-half within them), the rest pass unrotated; its frequencies are those of a rotary_dim head.
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False  # Llama with mlp_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # Mistral: a query sees itself and the sliding_window - 1 keys before it
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE; jaxpage.models.moe): every layer's MLP is num_experts
    # SiLU-gated experts of moe_intermediate_size features, num_experts_per_tok of them per token, their weights
    # renormalized over the chosen ones when norm_topk_prob; Qwen2-MoE adds a gated shared expert of
    # shared_expert_intermediate_size features. num_experts 0: a dense MLP of intermediate_size features.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # How the model runs, not what it is: with expert parallelism (EngineConfig.enable_expert_parallel), the routed
    # experts split over this many tensor-parallel shards (jaxpage.worker.parallel); 1: every shard has every expert.
    expert_parallel_size: int = 1
    # Gemma 2 and 3 (jaxpage.models.llama): a GELU MLP, RMSNorm scaling by (1 + weight), the embedding multiplied by
    # sqrt(hidden_size), attention scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5, logits of the
    # attention and of the LM head soft-capped (cap * tanh(x / cap)), norms after the attention and MLP outputs
    # (sandwich_norms), and a type per layer: "sliding_attention" layers see sliding_window keys, "full_attention"
    # layers all (None: every layer as sliding_window says). Gemma 3's sliding layers rotate with their own RoPE base,
    # rope_local_theta, unscaled.
    hidden_act: str = "silu"
    norm_weight_offset: float = 0.0
    embedding_multiplier: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sandwich_norms: bool = False
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    # The weights as stored in the parameters: None (floats) or "int8" (every projection and the embedding: int8
    # with a float32 scale per output channel, see jaxpage.models.int8).
    quantization: str | None = None

    QUANTIZATIONS = QUANTIZATIONS

    def __post_init__(self):
        assert self.architecture in SUPPORTED_ARCHITECTURES, self.architecture
        assert self.quantization is None or self.quantization in self.QUANTIZATIONS, self.quantization
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            assert getattr(self, name) > 0, (name, getattr(self, name))
        assert self.num_heads % self.num_kv_heads == 0, (self.num_heads, self.num_kv_heads)
        assert self.head_dim > 0 and self.head_dim % 2 == 0, self.head_dim
        assert self.sliding_window is None or self.sliding_window > 0, self.sliding_window
        assert isinstance(self.eos_token_ids, tuple), self.eos_token_ids
        assert self.rope_freq_factors is None or len(self.rope_freq_factors) == self.head_dim // 2
        assert 0 < self.partial_rotary_factor <= 1 and self.rotary_dim > 0 and self.rotary_dim % 2 == 0, self.rotary_dim
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "longrope":
            lengths = {len(self.rope_scaling.short_factor), len(self.rope_scaling.long_factor)}
            assert lengths == {self.rotary_dim // 2}, (self.rope_scaling, self.rotary_dim)
        if self.num_experts:
            assert 1 <= self.num_experts_per_tok <= self.num_experts, (self.num_experts_per_tok, self.num_experts)
            assert self.moe_intermediate_size > 0, self.moe_intermediate_size
        assert self.shared_expert_intermediate_size >= 0, self.shared_expert_intermediate_size
        assert self.expert_parallel_size == 1 or self.num_experts % self.expert_parallel_size == 0
        assert self.hidden_act in HIDDEN_ACTS, self.hidden_act
        if self.layer_types is not None:
            assert isinstance(self.layer_types, tuple) and len(self.layer_types) == self.num_layers, self.layer_types
            assert set(self.layer_types) <= set(LAYER_TYPES), self.layer_types
            assert self.sliding_window is not None or "sliding_attention" not in self.layer_types

    @property
    def attention_scale(self) -> float:
        """The factor of q.k in attention: query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def hybrid_attention(self) -> bool:
        """Whether some layers slide and others see everything (Gemma 2 and 3): each layer picks its window."""
        return self.layer_types is not None and len(set(self.layer_types)) > 1

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends through sliding_window."""
        if self.layer_types is None:
            return (self.sliding_window is not None,) * self.num_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head that RoPE rotates: int(head_dim * partial_rotary_factor), as transformers."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token takes in the cache: 2 * layers * kv_heads * head_dim * dtype_bytes (the
        attention backend's pool may pad head_dim: see AttentionBackend.kv_bytes_per_token)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    # ----- (de)serialization -----

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        fields = json.loads(text)
        if fields.get("rope_scaling") is not None:
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
        for key in ("rope_freq_factors", "layer_types"):
            if fields.get(key) is not None:
                fields[key] = tuple(fields[key])
        return cls(**fields)

    @classmethod
    def from_hf_config(
        cls, hf: dict[str, Any], source: str = "config.json", names: dict[str, str] | None = None
    ) -> ModelConfig:
        """Builds the config from a Hugging Face config dict (transformers 4 or 5 layout).

        Raises ModelLoadError naming `source` and the field for architectures and options jaxpage does not support and
        for a missing, mistyped or out-of-range number. `names`: how the source calls a field, by its HF name (a GGUF
        file's metadata keys), for those messages.
        """
        names = names or {}

        def name(key: str) -> str:
            return names.get(key, key)

        arch = hf.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: model_type {arch!r} is not supported; jaxpage runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch not in GEMMA_ARCHITECTURES and hf.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
        if hf.get("use_sliding_window"):
            raise ModelLoadError(f"{source}: per-layer sliding windows ({arch} use_sliding_window) are not supported")
        try:
            _refuse_unsupported_moe_options(hf, arch)
            sizes = _sizes_from_hf(hf, name)
            rope_theta, rope_scaling = _rope_from_hf(hf, name)
            gemma = _gemma_from_hf(hf, arch, name, sizes["num_layers"])
            if "rope_theta" in gemma:  # Gemma 3's global layers' RoPE, from its per-layer-type parameters
                rope_theta, rope_scaling = gemma.pop("rope_theta"), gemma.pop("rope_scaling")
            window = hf.get("sliding_window", 4096 if arch in GEMMA_ARCHITECTURES else None)  # HF's defaults
            window = window if arch in ("mistral", "mixtral", "phi3", *GEMMA_ARCHITECTURES) else None
            attention_bias = bool(hf.get("attention_bias", False))
            eos = hf.get("eos_token_id")
            return cls(
                architecture=arch,
                **sizes,
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch in GEMMA_ARCHITECTURES)),
                qkv_bias=_qkv_bias(hf, arch, attention_bias),
                o_bias=attention_bias and arch in ("llama", *GEMMA_ARCHITECTURES),
                mlp_bias=bool(hf.get("mlp_bias", False)) and arch == "llama",
                qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3_text"),
                **_moe_from_hf(hf, arch, name),
                partial_rotary_factor=_partial_rotary_from_hf(hf, arch, name, sizes["head_dim"], rope_scaling),
                **gemma,
                sliding_window=None if window is None else _size(name("sliding_window"), window),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            )
        except ModelLoadError as e:
            raise ModelLoadError(f"{source}: {e}") from None
        except KeyError as e:
            raise ModelLoadError(f"{source}: required field {name(e.args[0])!r} is missing") from None
        except (AssertionError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: inconsistent model config ({e})") from None


def _qkv_bias(hf: dict[str, Any], arch: str, attention_bias: bool) -> bool:
    """Whether q, k and v have biases: always in Qwen2, in Qwen2-MoE unless qkv_bias says not, where attention_bias
    says so in Llama, Qwen3 and Qwen3-MoE."""
    if arch == "qwen2":
        return True
    if arch == "qwen2_moe":
        return bool(hf.get("qkv_bias", True))
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
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= set(LAYER_TYPES):
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
        raise ModelLoadError(f"{name(key)} {act!r} is not supported (only 'gelu_pytorch_tanh')")
    if hf.get("use_bidirectional_attention"):
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
    dense_layers = hf.get("mlp_only_layers") or []
    if dense_layers:
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
        shared_expert_intermediate_size=0 if not shared else _size(name("shared_expert_intermediate_size"), shared),
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
        raise ModelLoadError(f"RoPE type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
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


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """What is loaded, and how (jaxpage.engine.llm_engine.load_models, the tokenizer): EngineConfig's arguments of
    it."""

    model: str | None
    dtype: str | None
    quantization: str | None
    load_format: str
    skip_tokenizer_init: bool


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV pool: its size (jaxpage.worker.pool_sizing), its pages (the block managers), its format (the attention
    backend)."""

    page_size: int
    num_pages: int | None
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    kv_cache_dtype: str
    enable_prefix_caching: bool


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Devices and hosts: the mesh (jaxpage.worker.parallel) and the processes joined (jaxpage.worker.process_group)."""

    tensor_parallel_size: int
    data_parallel_size: int
    enable_expert_parallel: bool
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """A step's budgets and when a sequence ends (jaxpage.engine.scheduler)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # a sequence ends ("length") when it has this many tokens; None: no limit
    eos_token_ids: frozenset[int] = frozenset()  # tokens that end a sequence ("stop") unless it ignores EOS

    def __post_init__(self):
        assert self.max_num_seqs >= 1, self.max_num_seqs
        assert self.max_num_batched_tokens >= 1, self.max_num_batched_tokens


def arg(default, help: str, *, choices: tuple | None = None, metavar: str | None = None, cli="engine", off=None):
    """An engine argument: its default, and what the CLI makes of it (jaxpage.entrypoints.cli generates every flag from
    these). cli: the group of commands that take it as a flag ("model": every command that loads a model; "engine":
    those that run an engine; "hosts": those, in the several-hosts group; None: no flag); off: (flag, help) of a second
    flag that sets it to None."""
    metadata = dict(help=help, choices=choices, metavar=metavar, cli=cli, off=off)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine arguments, in vLLM's names where vLLM has one. Each is checked when the config is built: a bad one
    raises ValueError naming the argument and its value (ArgumentTypeError, a TypeError too, for a wrong type).

    KV pool size, first match wins: `num_pages`; `kv_cache_memory_bytes`; on GPU/TPU
    `gpu_memory_utilization` of the device memory left after the weights; on CPU 2 GiB. The engine refuses a pool
    larger than the memory it can have, and one that cannot hold a single max_model_len sequence (when
    max_model_len is left to the model's default, it is lowered to what the pool holds instead, with a warning).
    """

    model: str | None = arg(
        None, "HF model directory, .gguf file or jaxpage checkpoint (default: SmolLM2-135M-Instruct)", cli="model"
    )
    dtype: str | None = arg(
        None, "parameter dtype (default: float32 on CPU, bfloat16 on GPU/TPU)", choices=DTYPES, cli="model"
    )
    # "int8": the model's projections and embedding in int8 with a float32 scale per output channel, quantized as
    # they load (jaxpage.models.int8); None: the weights as stored (a jaxpage checkpoint keeps its own).
    quantization: str | None = arg(
        None,
        "int8: weights in int8 with a scale per output channel, quantized as they load (default: off)",
        choices=QUANTIZATIONS,
        cli="model",
    )
    # The KV pool's format, in vLLM's names: "auto" (the compute dtype), "int8", "fp8" (same as "fp8_e4m3") or
    # "fp8_e5m2": 8-bit pages with a bfloat16 scale per token per KV head, applied inside the attention kernels
    # (jaxpage.attention). Kept canonical: "fp8" becomes "fp8_e4m3".
    kv_cache_dtype: str = arg(
        "auto",
        "the KV pages: auto (the model's dtype), or 8 bits with a scale per token per KV head, applied inside the "
        "attention kernels: int8, fp8 (= fp8_e4m3), fp8_e5m2 (default: auto)",
        choices=KV_CACHE_DTYPES,
    )
    max_model_len: int | None = arg(None, "default: the model's context length")  # the model's max_position_embeddings
    page_size: int = arg(16, "tokens per KV page, 1 to 1024 (default 16)")
    num_pages: int | None = arg(None, "pages in the KV pool, the null page included (default: from the budget)")
    kv_cache_memory_bytes: int | None = arg(None, "the KV pool's memory budget in bytes (default: see README)")
    gpu_memory_utilization: float = arg(
        0.9, "share of a GPU/TPU's memory for the weights and the KV pool (default 0.9)"
    )
    max_num_seqs: int = arg(64, "sequences per step (default 64)")  # 1 to MAX_NUM_SEQS
    max_num_batched_tokens: int = arg(512, "tokens per step (default 512)")  # 1 to MAX_NUM_BATCHED_TOKENS
    enable_prefix_caching: bool = arg(True, "requests that share a prompt prefix share its pages (default: on)")
    seed: int = arg(0, "seeds the requests that bring none; >= 0 (default 0)")
    # The attention backend (jaxpage.attention): "auto" (the Pallas kernels on TPU and GPU, the XLA
    # implementation elsewhere), "xla", "pallas" (this platform's kernels), "pallas_tpu", "pallas_gpu", or
    # "pallas_tpu_interpret" / "pallas_gpu_interpret" (those kernels in Pallas' interpreter, any platform: for tests).
    attention_impl: str = arg(
        "auto", "the attention kernels (default auto: Pallas on TPU and GPU, XLA elsewhere)", choices=ATTENTION_IMPLS
    )
    # The persistent compilation cache (see jaxpage.worker.compilation_cache): a later start with the same model and
    # arguments loads its compiled steps from this directory instead of compiling them. "auto": the folder
    # "compilation-cache" of jaxpage's cache directory ($JAXPAGE_CACHE, else ~/.cache/jaxpage). None: no cache.
    compilation_cache_dir: str | None = arg(
        "auto",
        "the persistent compilation cache: a later run with the same model loads its compiled steps from here "
        "(default: compilation-cache in $JAXPAGE_CACHE, else ~/.cache/jaxpage)",
        metavar="DIR",
        off=("--no-compilation-cache", "compile everything in this process; read and write no compilation cache"),
    )
    # "auto": the weights of `model`; "dummy": random weights, the config of `model`
    load_format: str = arg(
        "auto", "auto: the model's weights; dummy: random weights (default auto)", choices=LOAD_FORMATS
    )
    skip_tokenizer_init: bool = arg(False, "no tokenizer: prompts and outputs are token ids", cli=None)
    # Speculative decoding (jaxpage.spec_decode): None (off), a SpeculativeConfig, a dict in vLLM's keys such as
    # {"method": "ngram", "num_speculative_tokens": 3}, or that dict as a JSON string. Kept as a SpeculativeConfig.
    speculative_config: SpeculativeConfig | dict | str | None = arg(
        None,
        'speculative decoding, in vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (default: off)',
        metavar="JSON",
    )
    # Tensor parallelism (jaxpage.worker.parallel): the model split over this many devices, Megatron-style; 1: one
    # device.
    tensor_parallel_size: int = arg(1, "devices to split the model over, as Megatron (default 1)")
    # Data parallelism: this many replicas of the model (each tensor_parallel_size devices), each with its own pages
    # and scheduler state, stepping together; new requests go where their prefix is cached, else to the least loaded.
    data_parallel_size: int = arg(1, "replicas of the model, each its own pages (default 1)")
    # Expert parallelism (vLLM's name; jaxpage.worker.parallel): a mixture of experts' routed experts split whole over
    # the tensor_parallel_size shards (E / tp experts each) instead of every expert by its features. No effect on a
    # dense model or on one device.
    enable_expert_parallel: bool = arg(
        False, "split a mixture of experts' experts over the tensor-parallel devices, whole (default: off)"
    )
    # Asynchronous scheduling (LLMEngine.step): the host schedules and prepares step n + 1 while the device runs step
    # n, which feeds its sampled tokens to step n + 1 on the device; the same tokens as synchronous scheduling.
    # None: on for GPU and TPU, off on CPU; not with speculative decoding or several hosts.
    async_scheduling: bool | None = arg(
        None, "schedule the next step while the device runs this one (default: on GPU and TPU, off on CPU)"
    )
    # Several hosts (jaxpage.entrypoints.distributed): one process per host, joined by jax.distributed.initialize with
    # these (None: for JAX to find, e.g. on a TPU pod; JAX reads $JAX_COORDINATOR_ADDRESS itself). Process 0 serves; the
    # others follow it (LLMEngine.follow). All None and no $JAX_COORDINATOR_ADDRESS: one process.
    coordinator_address: str | None = arg(  # host:port of process 0's coordination service
        None, "process 0's address, reachable by all", metavar="HOST:PORT", cli="hosts"
    )
    num_processes: int | None = arg(None, "processes in all, one per host", cli="hosts")
    process_id: int | None = arg(None, "this process's index, 0 to --num-processes - 1", cli="hosts")

    CPU_KV_CACHE_BYTES = 2 << 30
    ATTENTION_IMPLS = ATTENTION_IMPLS
    DTYPES = DTYPES
    QUANTIZATIONS = QUANTIZATIONS
    KV_CACHE_DTYPES = KV_CACHE_DTYPES
    MAX_PAGE_SIZE = 1024
    MAX_NUM_SEQS = 1 << 16
    MAX_NUM_BATCHED_TOKENS = 1 << 20

    def part(self, cls):
        """The config `cls` (LoadConfig, CacheConfig, ParallelConfig) made of these arguments of the same names."""
        return cls(**{field.name: getattr(self, field.name) for field in dataclasses.fields(cls)})

    def scheduler_config(self, max_model_len: int, eos_token_ids: frozenset[int]) -> SchedulerConfig:
        """The scheduler's config, once the engine knows max_model_len (the pool may lower it) and EOS."""
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_model_len, eos_token_ids)

    def __post_init__(self):
        def arg(field: str) -> str:
            return f"engine argument {field}"

        def choose(field: str, choices: tuple) -> None:
            value = getattr(self, field)
            if not isinstance(value, str) or value not in choices:
                fail(arg(field), " or ".join(choices), value, wrong_type=not isinstance(value, str))

        def put(field: str, value) -> None:
            object.__setattr__(self, field, value)  # frozen: the checked, canonical value

        if self.model is not None:
            put("model", check_path(arg("model"), self.model))
        if self.dtype == "auto":
            put("dtype", None)
        if self.dtype is not None:
            choose("dtype", self.DTYPES)
        put("page_size", check_int(arg("page_size"), self.page_size, 1, self.MAX_PAGE_SIZE))
        put("max_num_seqs", check_int(arg("max_num_seqs"), self.max_num_seqs, 1, self.MAX_NUM_SEQS))
        put(
            "max_num_batched_tokens",
            check_int(arg("max_num_batched_tokens"), self.max_num_batched_tokens, 1, self.MAX_NUM_BATCHED_TOKENS),
        )
        if self.max_model_len is not None:
            put("max_model_len", check_int(arg("max_model_len"), self.max_model_len, 2, INT32_MAX))
        if self.num_pages is not None:
            # Slots (page * page_size + offset) are int32.
            put("num_pages", check_int(arg("num_pages"), self.num_pages, 2, INT32_MAX // self.page_size))
        if self.kv_cache_memory_bytes is not None:
            put("kv_cache_memory_bytes", check_int(arg("kv_cache_memory_bytes"), self.kv_cache_memory_bytes, 1))
        put(
            "gpu_memory_utilization",
            check_number(arg("gpu_memory_utilization"), self.gpu_memory_utilization, "in (0, 1]", lambda u: 0 < u <= 1),
        )
        check_bool(arg("enable_prefix_caching"), self.enable_prefix_caching)
        put("seed", check_int(arg("seed"), self.seed, 0))
        choose("attention_impl", self.ATTENTION_IMPLS)
        if self.compilation_cache_dir not in (None, "auto"):
            put("compilation_cache_dir", check_path(arg("compilation_cache_dir"), self.compilation_cache_dir))
        choose("load_format", LOAD_FORMATS)
        if self.quantization is not None:
            choose("quantization", ModelConfig.QUANTIZATIONS)
        choose("kv_cache_dtype", self.KV_CACHE_DTYPES)
        put("kv_cache_dtype", canonical_kv_cache_dtype(self.kv_cache_dtype))
        check_bool(arg("skip_tokenizer_init"), self.skip_tokenizer_init)
        put("speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        put("tensor_parallel_size", check_int(arg("tensor_parallel_size"), self.tensor_parallel_size, 1))
        put("data_parallel_size", check_int(arg("data_parallel_size"), self.data_parallel_size, 1))
        check_bool(arg("enable_expert_parallel"), self.enable_expert_parallel)
        if self.async_scheduling is not None:
            check_bool(arg("async_scheduling"), self.async_scheduling)
        if self.coordinator_address is not None:
            address = self.coordinator_address
            host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                fail(arg("coordinator_address"), "host:port", address, wrong_type=not isinstance(address, str))
        if self.num_processes is not None:
            put("num_processes", check_int(arg("num_processes"), self.num_processes, 1))
        if self.process_id is not None:
            limit = None if self.num_processes is None else self.num_processes - 1
            put("process_id", check_int(arg("process_id"), self.process_id, 0, limit))
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError(
                "engine argument async_scheduling: speculative decoding proposes its drafts from the tokens of the "
                "step before on the host; leave async_scheduling unset (or False) with speculative_config"
            )
        if self.data_parallel_size > 1 and self.speculative_config is not None:
            raise ValueError(
                "engine argument speculative_config: speculative decoding runs without data parallelism "
                f"(data_parallel_size is {self.data_parallel_size})"
            )
