"""Tiny random models of each family jaxpage serves, written as Hugging Face directories without torch.

A family is a transformers config class and its arguments; `write_tiny_model` writes what that model's
`save_pretrained` would hold (config.json, model.safetensors or shards with an index) from numpy: weights large
enough that mistakes show in the logits. The parity tests load the same directory with transformers, which checks
that every tensor name and shape is the one it expects.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class TinyFamily:
    name: str
    config_class: str  # transformers' config class: one of ARCHITECTURES
    kwargs: dict


# The engine of the tests whose workload does not depend on the engine's sizes (API, batch, server, streaming
# tests). A step program is keyed by the model, the pool's shape and the step shape, which these sizes set: engines of
# one configuration, in the test processes and in the commands they start, share every program through the persistent
# compilation cache ($JAXPAGE_CACHE, one per CI run), so only the first engine to reach a shape compiles it. A test
# that needs other sizes (a pool small enough to preempt, short chunks) says so with its own arguments.
TINY_ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, page_size=8)
# The full-vocabulary tiny model's (chat templates, text, HTTP): the same sizes, and a context limit of 96 the server
# tests' messages name.
FULL_VOCAB_ENGINE = TINY_ENGINE | dict(max_model_len=96)


def cli_options(engine_args: dict) -> list[str]:
    """The command-line options that give an engine these arguments: {"max_num_seqs": 8} -> ["--max-num-seqs", "8"]."""
    return [part for name, value in engine_args.items() for part in (f"--{name.replace('_', '-')}", str(value))]


TINY_COMMON_CONFIG = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, max_position_embeddings=256
)

TINY_FAMILIES = [
    TinyFamily("llama2-mha", "LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0)),
    TinyFamily(
        "llama3-gqa-rope-scaling",
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    TinyFamily(
        "llama-mqa-biases",
        "LlamaConfig",
        dict(num_attention_heads=4, num_key_value_heads=1, attention_bias=True, mlp_bias=True),
    ),
    TinyFamily(
        "llama-linear-rope",
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
        ),
    ),
    TinyFamily(
        "mistral-sliding-window",
        "MistralConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=5, head_dim=16),
    ),
    TinyFamily("qwen2-qkv-bias", "Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
    TinyFamily(
        "qwen3-qk-norm-head-dim", "Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    ),
    TinyFamily(
        "mixtral-top2-sliding-window",
        "MixtralConfig",
        dict(
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=12
        ),
    ),
    TinyFamily(
        "qwen2-moe-shared-expert",
        "Qwen2MoeConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
        ),
    ),
    TinyFamily(
        "qwen3-moe-norm-topk",
        "Qwen3MoeConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
    ),
    TinyFamily(
        "gemma2-softcap-hybrid",
        "Gemma2Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=6,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
        ),
    ),
    TinyFamily(
        "gemma3-qk-norm-local-rope",
        "Gemma3TextConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=6,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                full_attention=dict(rope_type="linear", rope_theta=1000000.0, factor=4.0),
            ),
        ),
    ),
    TinyFamily(
        "smollm2-tied",
        "LlamaConfig",
        dict(
            num_attention_heads=6, num_key_value_heads=2, hidden_size=96, tie_word_embeddings=True, rope_theta=100000.0
        ),
    ),
    # Phi-3: fused qkv_proj and gate_up_proj tensors. LongRoPE in the layout of Phi-3-mini-128k / Phi-3.5's config.json
    # (rope_scaling with "type", original_max_position_embeddings at the top level), with a sliding window as
    # Phi-3-mini-4k has one; short and long factors (one per pair of dimensions) far apart, so a mix-up shows.
    TinyFamily(
        "phi3-longrope",
        "Phi3Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            original_max_position_embeddings=32,
            sliding_window=12,
            pad_token_id=0,  # Phi3Config's 32000 is past the tiny vocabulary (torch's Embedding refuses it)
            rope_scaling=dict(
                type="longrope",
                short_factor=[1.0, 1.1, 1.25, 1.4, 1.6, 2.0, 2.5, 3.0],
                long_factor=[1.5, 2.0, 3.0, 4.5, 6.0, 9.0, 12.0, 16.0],
            ),
        ),
    ),
    # Phi-4-mini: a partial rotary factor of 0.75 (12 of 16 dimensions rotated), LongRoPE, GQA, tied embeddings; in
    # transformers 5's layout (rope_parameters).
    TinyFamily(
        "phi4-mini-partial-rotary",
        "Phi3Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            original_max_position_embeddings=24,
            pad_token_id=0,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                partial_rotary_factor=0.75,
                short_factor=[1.0, 1.05, 1.2, 1.5, 1.9, 2.4],
                long_factor=[1.2, 2.0, 3.5, 6.0, 10.0, 16.0],
            ),
        ),
    ),
]

# The families whose model differs from Llama's beyond biases, norms and RoPE scaling: mixtures of experts, Gemma's
# hybrids, Phi-3's fused weights and LongRoPE.
FAMILIES_BEYOND_LLAMA = (
    "mixtral-top2-sliding-window",
    "qwen2-moe-shared-expert",
    "qwen3-moe-norm-topk",
    "gemma2-softcap-hybrid",
    "gemma3-qk-norm-local-rope",
    "phi3-longrope",
    "phi4-mini-partial-rotary",
)

# config class -> (model_type, architecture, the defaults of that class that a config.json must state because
# jaxpage reads them and does not assume them: transformers' own config classes fill these in)
ARCHITECTURES = {
    "LlamaConfig": ("llama", "LlamaForCausalLM", dict(bos_token_id=1, eos_token_id=2)),
    "MistralConfig": ("mistral", "MistralForCausalLM", dict(bos_token_id=1, eos_token_id=2)),
    "Qwen2Config": ("qwen2", "Qwen2ForCausalLM", {}),
    "Qwen3Config": ("qwen3", "Qwen3ForCausalLM", {}),
    "MixtralConfig": (
        "mixtral",
        "MixtralForCausalLM",
        dict(bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, rope_theta=1e6),
    ),
    "Qwen2MoeConfig": ("qwen2_moe", "Qwen2MoeForCausalLM", {}),
    "Qwen3MoeConfig": ("qwen3_moe", "Qwen3MoeForCausalLM", {}),
    "Gemma2Config": ("gemma2", "Gemma2ForCausalLM", dict(bos_token_id=2, eos_token_id=1)),
    "Gemma3TextConfig": ("gemma3_text", "Gemma3ForCausalLM", dict(bos_token_id=2, eos_token_id=1)),
    "Phi3Config": ("phi3", "Phi3ForCausalLM", dict(bos_token_id=1, eos_token_id=32000, rms_norm_eps=1e-5)),
}


def tiny_config(family: TinyFamily) -> dict:
    """The family's config.json."""
    model_type, architecture, defaults = ARCHITECTURES[family.config_class]
    config = dict(architectures=[architecture], model_type=model_type, **defaults)
    return config | TINY_COMMON_CONFIG | family.kwargs


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model, by its transformers name, in a fixed order."""
    d, f, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or d // heads
    model_type = config["model_type"]
    attention_bias = config.get("attention_bias", False) and model_type in ("llama", "qwen3")
    layer = {
        "input_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (heads * hd, d),
        "self_attn.k_proj.weight": (kv_heads * hd, d),
        "self_attn.v_proj.weight": (kv_heads * hd, d),
        "self_attn.o_proj.weight": (d, heads * hd),
        "post_attention_layernorm.weight": (d,),
    }
    layer |= (
        moe_tensor_shapes(config)
        if "moe" in model_type or model_type == "mixtral"
        else {
            "mlp.gate_proj.weight": (f, d),
            "mlp.up_proj.weight": (f, d),
            "mlp.down_proj.weight": (d, f),
        }
    )
    if attention_bias or model_type in ("qwen2", "qwen2_moe"):
        layer |= {"self_attn.q_proj.bias": (heads * hd,), "self_attn.k_proj.bias": (kv_heads * hd,)}
        layer |= {"self_attn.v_proj.bias": (kv_heads * hd,)}
    if attention_bias:
        layer["self_attn.o_proj.bias"] = (d,)
    if model_type in ("gemma2", "gemma3_text"):  # the attention's and the MLP's outputs normed, and the MLP's input
        layer |= {f"{n}_feedforward_layernorm.weight": (d,) for n in ("pre", "post")}
    if model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
        layer |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    if config.get("mlp_bias", False) and model_type == "llama":
        layer |= {"mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,), "mlp.down_proj.bias": (d,)}
    if model_type == "phi3":
        layer = phi3_fused_shapes(layer)
    shapes = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(config["num_hidden_layers"]):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    shapes["model.norm.weight"] = (d,)
    if not config.get("tie_word_embeddings", model_type in ("gemma2", "gemma3_text")):
        shapes["lm_head.weight"] = (vocab, d)
    return shapes


def phi3_fused_shapes(layer: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A Llama layer's tensors as Phi-3 checkpoints hold them: q, k and v in one self_attn.qkv_proj (their rows in
    that order), gate and up in one mlp.gate_up_proj."""
    layer = dict(layer)
    q, k, v = (layer.pop(f"self_attn.{p}_proj.weight") for p in "qkv")
    gate, up = (layer.pop(f"mlp.{p}_proj.weight") for p in ("gate", "up"))
    qkv = {"self_attn.qkv_proj.weight": (q[0] + k[0] + v[0], q[1])}
    return layer | qkv | {"mlp.gate_up_proj.weight": (gate[0] + up[0], gate[1])}


def moe_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """A mixture-of-experts layer's MLP tensors as checkpoints name them: Mixtral's block_sparse_moe (experts w1 =
    gate, w3 = up, w2 = down), Qwen-MoE's mlp (and Qwen2-MoE's shared expert)."""
    d = config["hidden_size"]
    if config["model_type"] == "mixtral":
        e, f = config["num_local_experts"], config["intermediate_size"]
        shapes = {"block_sparse_moe.gate.weight": (e, d)}
        for j in range(e):
            shapes |= {f"block_sparse_moe.experts.{j}.{w}.weight": (f, d) for w in ("w1", "w3")}
            shapes[f"block_sparse_moe.experts.{j}.w2.weight"] = (d, f)
        return shapes
    e, f = config["num_experts"], config["moe_intermediate_size"]
    shapes = {"mlp.gate.weight": (e, d)}
    for j in range(e):
        shapes |= {f"mlp.experts.{j}.gate_proj.weight": (f, d), f"mlp.experts.{j}.up_proj.weight": (f, d)}
        shapes[f"mlp.experts.{j}.down_proj.weight"] = (d, f)
    s = config.get("shared_expert_intermediate_size")
    if s:
        shapes |= {f"mlp.shared_expert.{p}.weight": (s, d) for p in ("gate_proj", "up_proj")}
        shapes |= {"mlp.shared_expert.down_proj.weight": (d, s), "mlp.shared_expert_gate.weight": (1, d)}
    return shapes


def write_tiny_model(family: TinyFamily, directory: Path, seed: int = 0, max_shard_bytes: int | None = None) -> Path:
    """Writes the family's model with random float32 weights (norm scales 1 + 0.2 N(0, 1), the rest 0.15 N(0, 1)) into
    `directory` and returns it. With max_shard_bytes, the tensors go into shards of about that size and an index,
    as save_pretrained(max_shard_size=...) writes them."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config(family)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in tensor_shapes(config).items():
        scale, shift = (0.2, 1.0) if "norm" in name else (0.15, 0.0)
        tensors[name] = (shift + scale * rng.standard_normal(shape)).astype(np.float32)
    (directory / "config.json").write_text(json.dumps(config | {"dtype": "float32"}, indent=2))
    shards: list[dict[str, np.ndarray]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        if max_shard_bytes and shards[-1] and shard_bytes + tensor.nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += tensor.nbytes
    if len(shards) == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return directory
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return directory
