"""ModelConfig: the frozen, hashable description of a Llama-family model, and its RoPE scaling.

Built from a Hugging Face `config.json` or from GGUF metadata (jaxpage.config.hf_config.model_config_from_hf, which
`jaxpage.models.hf_loader` and `jaxpage.models.gguf_loader` call). Hashable so it can be a static argument of
`jax.jit`.
"""

from __future__ import annotations

import dataclasses
import json

from jaxpage.config.weight_quantization import WeightQuantization

SUPPORTED_ARCHITECTURES = (
    "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3_text", "phi3",
)  # fmt: skip
GEMMA_ARCHITECTURES = ("gemma2", "gemma3_text")
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names of a layer's attention
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # the MLP's activation: Llama's SiLU, Gemma's tanh-approximated GELU
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
QUANTIZATIONS = ("int8",)  # how the weights may be stored (also the engine argument quantization's choices)


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
    # How the model runs: batch-invariant (EngineConfig.batch_invariant; jaxpage.models.batch_invariant): every row's
    # products and reductions computed in shapes that do not depend on the other rows of its step.
    batch_invariant: bool = False
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
    # with a float32 scale per output channel, see jaxpage.models.int8; beside weight_quantization, those the
    # checkpoint leaves in floats).
    quantization: str | None = None
    # A pre-quantized checkpoint's weights as stored (FP8, AWQ, GPTQ, compressed-tensors: see
    # jaxpage.config.weight_quantization); None for float weights.
    weight_quantization: WeightQuantization | None = None

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
        return json.dumps(dataclasses.asdict(self), indent=2, default=sorted)  # sets (weight_quantization's) sorted

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        fields = json.loads(text)
        if fields.get("rope_scaling") is not None:
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
        for key in ("rope_freq_factors", "layer_types"):
            if fields.get(key) is not None:
                fields[key] = tuple(fields[key])
        if fields.get("weight_quantization") is not None:
            q = fields["weight_quantization"]
            q |= {"block": tuple(q["block"]), "quantized": frozenset(q["quantized"])}
            fields["weight_quantization"] = WeightQuantization(**q)
        return cls(**fields)
