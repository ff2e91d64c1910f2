"""GGUF loading: tiny models written the way llama.cpp writes them, and the real SmolLM2 file."""

from __future__ import annotations

import dataclasses
import math

import gguf
import numpy as np
import pytest
import torch
from hf_reference import PARITY_PROMPTS, TINY_FAMILIES, hf_logits, hf_logits_split, longrope_switch, make_tiny_hf_model
from tiny_models import FAMILIES_BEYOND_LLAMA

from jaxpage.errors import ModelLoadError
from jaxpage.models import forward, load_model
from jaxpage.models.gguf_loader import (
    GEMMA_LAYER_TENSOR_NAMES,
    GLOBAL_TENSOR_NAMES,
    LAYER_TENSOR_NAMES,
    PHI3_LAYER_TENSOR_NAMES,
    PHI3_ROPE_FACTORS,
    config_from_gguf,
    load_gguf,
    open_gguf,
)
from jaxpage.models.weights import layer_tensor_specs
from jaxpage.tokenizers.tokenizer import encode_prompt, load_tokenizer

GGUF_ARCH = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mixtral": "llama",
    "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3",
}  # fmt: skip
# What a GGUF cannot say differently from llama.cpp's rules, said as llama.cpp assumes it: query_pre_attn_scalar
# (head_dim below 27B) and Gemma 3's layer pattern (every sixth layer global, unless the metadata lists them).
GEMMA_AS_LLAMA_CPP_ASSUMES = {
    "gemma2-softcap-hybrid": dict(query_pre_attn_scalar=16),
    "gemma3-qk-norm-local-rope": dict(num_hidden_layers=6, layer_types=[*["sliding_attention"] * 5, "full_attention"]),
}
GGUF_FAMILIES = [
    f
    for f in TINY_FAMILIES
    if f.name
    in (
        "llama2-mha",
        "llama3-gqa-rope-scaling",
        "llama-mqa-biases",
        "qwen2-qkv-bias",
        "qwen3-qk-norm-head-dim",
        "smollm2-tied",
        "mistral-sliding-window",
        # Phi-3's as they are: llama.cpp's metadata says everything they use (LongRoPE, the partial rotary factor,
        # the sliding window; llama.cpp itself currently runs Phi-3 without its window, transformers and jaxpage with
        # it). Gemma's as GEMMA_AS_LLAMA_CPP_ASSUMES says.
        *FAMILIES_BEYOND_LLAMA,
    )
]
GGUF_FAMILIES = [
    dataclasses.replace(f, kwargs=f.kwargs | GEMMA_AS_LLAMA_CPP_ASSUMES[f.name])
    if f.name in GEMMA_AS_LLAMA_CPP_ASSUMES
    else f
    for f in GGUF_FAMILIES
]


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama Q/K rows (so RoPE rotates interleaved pairs)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensor_name(hf: str, renames: dict[str, str] | None = None) -> str:
    """The inverse of the loader's GGUF -> transformers renaming (`renames`: the architecture's layer names that
    differ from Llama's, GEMMA_LAYER_TENSOR_NAMES or PHI3_LAYER_TENSOR_NAMES)."""
    inverse = {v: k for k, v in GLOBAL_TENSOR_NAMES.items()}
    if hf in inverse:
        return inverse[hf]
    _, _, layer, suffix = hf.split(".", 3)
    names = {v: k for k, v in (LAYER_TENSOR_NAMES | (renames or {})).items()}
    return f"blk.{layer}." + names[suffix]


def gguf_moe_tensors(name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
    """A mixture of experts' tensor of transformers 5's model (experts fused: gate_up_proj [E, 2F, D], down_proj
    [E, D, F]) as llama.cpp's converter writes it: one [E, out, in] tensor per projection, the router as
    ffn_gate_inp, the shared expert's gate as a vector. None for other tensors."""
    parts = name.split(".")
    if (
        len(parts) < 5
        or parts[3] != "mlp"
        or parts[4] not in ("gate", "experts", "shared_expert", "shared_expert_gate")
    ):
        return None
    block, rest = f"blk.{parts[2]}.", ".".join(parts[4:])
    if rest == "experts.gate_up_proj":
        half = data.shape[1] // 2
        return [(block + "ffn_gate_exps.weight", data[:, :half]), (block + "ffn_up_exps.weight", data[:, half:])]
    names = {
        "experts.down_proj": "ffn_down_exps.weight",
        "gate.weight": "ffn_gate_inp.weight",
        "shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
        "shared_expert.up_proj.weight": "ffn_up_shexp.weight",
        "shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    }
    if rest == "shared_expert_gate.weight":
        return [(block + "ffn_gate_inp_shexp.weight", data.reshape(-1))]
    return [(block + names[rest], data)]


def llama_cpp_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for Llama 3 RoPE scaling: a divisor per frequency."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old_len = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / rope["low_freq_factor"], old_len / rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (old_len / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.asarray(factors, np.float32)


def llama_cpp_phi3_metadata(writer, hf) -> list[tuple[str, np.ndarray]]:
    """What llama.cpp's converter (convert_hf_to_gguf.py's Phi3MiniModel) writes for Phi-3 where Llama's writer
    differs: no key_length (head_dim is embedding_length / head_count), the rotary dim as rope.dimension_count, the
    original context length, the sliding window (0: none), and for LongRoPE the attention factor as it computes it
    (from max_position_embeddings / original_max_position_embeddings) and the factors, returned as the tensors to
    write."""
    rope = hf.rope_parameters
    original = rope["original_max_position_embeddings"]
    partial = rope.get("partial_rotary_factor", 1.0)
    writer.add_rope_dimension_count(int(partial * hf.hidden_size) // hf.num_attention_heads)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(hf.sliding_window or 0)
    if not rope.get("long_factor"):
        return []
    scale = hf.max_position_embeddings / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    return [(tensor, np.asarray(rope[key], np.float32)) for key, tensor in PHI3_ROPE_FACTORS.items()]


def write_gguf(model, path) -> None:
    """Writes a transformers model as a float32 GGUF file, as llama.cpp's converter lays it out."""
    hf = model.config
    arch = GGUF_ARCH[hf.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(hf.num_hidden_layers)
    writer.add_context_length(hf.max_position_embeddings)
    writer.add_embedding_length(hf.hidden_size)
    writer.add_feed_forward_length(hf.intermediate_size)
    writer.add_head_count(hf.num_attention_heads)
    writer.add_head_count_kv(hf.num_key_value_heads)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    extra_tensors = llama_cpp_phi3_metadata(writer, hf) if arch == "phi3" else []
    if arch != "phi3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rope = hf.rope_parameters.get("full_attention", hf.rope_parameters)  # Gemma 3: the global layers'
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(hf, key, None) is not None:
            getattr(writer, f"add_{key}")(getattr(hf, key))
    writer.add_layer_norm_rms_eps(hf.rms_norm_eps)
    writer.add_vocab_size(hf.vocab_size)
    writer.add_eos_token_id(2)
    if getattr(hf, "sliding_window", None) and arch != "phi3":
        writer.add_sliding_window(hf.sliding_window)
    experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(hf.num_experts_per_tok)
        if hf.model_type != "mixtral":
            writer.add_expert_feed_forward_length(hf.moe_intermediate_size)
        if getattr(hf, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(hf.shared_expert_intermediate_size)
    if rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(hf.rope_parameters, head_dim))
    for name, data in extra_tensors:
        writer.add_tensor(name, data)
    renames = GEMMA_LAYER_TENSOR_NAMES if arch.startswith("gemma") else {}
    renames = PHI3_LAYER_TENSOR_NAMES if arch == "phi3" else renames
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and hf.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            data = llama_cpp_permute(data, hf.num_attention_heads)
        if arch == "llama" and ".k_proj." in name:
            data = llama_cpp_permute(data, hf.num_key_value_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp's converter stores Gemma's norms as the scale they apply
        for gguf_name, part in gguf_moe_tensors(name, data) or [(gguf_tensor_name(name, renames), data)]:
            writer.add_tensor(gguf_name, np.ascontiguousarray(part))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("family", GGUF_FAMILIES, ids=lambda f: f.name)
def test_tiny_gguf_logits_match_transformers(family, tmp_path):
    model = make_tiny_hf_model(family)
    write_gguf(model, tmp_path / "tiny.gguf")
    config, params = load_model(tmp_path / "tiny.gguf")
    rng = np.random.default_rng(2)
    # LongRoPE: 17 tokens stay below the switch to the long factors (original_max_position_embeddings, 24 or 32 in
    # the tiny families), so a prompt past it too, against transformers fed as jaxpage's per-position rule reads it.
    split = longrope_switch(model.config)
    for length in (17,) if split is None else (17, split + 9):
        prompt = rng.integers(0, config.vocab_size, length).tolist()
        ours = np.asarray(forward(config, params, [prompt]))[0]
        reference = hf_logits(model, prompt) if length <= (split or length) else hf_logits_split(model, prompt, split)
        np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0, err_msg=f"{length} tokens")


# A Phi-3 GGUF's header as llama.cpp's converter writes Phi-4-mini's (head_dim 64 / 4 = 16, 12 of them rotated), for
# config_from_gguf; metadata keys without "phi3.", None: left out.
PHI3_METADATA = {
    "block_count": 1,
    "context_length": 256,
    "embedding_length": 64,
    "feed_forward_length": 96,
    "attention.head_count": 4,
    "attention.head_count_kv": 2,
    "attention.layer_norm_rms_epsilon": 1e-5,
    "vocab_size": 96,
    "rope.dimension_count": 12,
    "rope.scaling.original_context_length": 24,
    "rope.scaling.attn_factor": 1.25,
    "attention.sliding_window": 0,
}
PHI3_FACTORS = {"rope_factors_short.weight": [1.0] * 6, "rope_factors_long.weight": [2.0] * 6}


def phi3_config_from_gguf(path, metadata=None, factors=None):
    """config_from_gguf of a Phi-3 GGUF of PHI3_METADATA updated with `metadata` and the factor tensors `factors`
    (None: PHI3_FACTORS), without the model's tensors."""
    writer = gguf.GGUFWriter(str(path), "phi3")
    for key, value in (PHI3_METADATA | (metadata or {})).items():
        if value is not None:
            (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"phi3.{key}", value)
    for name, values in (PHI3_FACTORS if factors is None else factors).items():
        writer.add_tensor(name, np.asarray(values, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return config_from_gguf(open_gguf(path), path)


def test_phi3_gguf_rotary_dim_and_longrope(tmp_path):
    """rope.dimension_count is Phi-3's rotary dim, not its head_dim (no key_length: embedding_length / head_count);
    a sliding window of 0 is none; the attention factor is the file's."""
    config = phi3_config_from_gguf(tmp_path / "m.gguf")
    assert (config.head_dim, config.rotary_dim, config.partial_rotary_factor) == (16, 12, 0.75)
    assert config.sliding_window is None
    scaling = config.rope_scaling
    assert (scaling.rope_type, scaling.original_max_position_embeddings) == ("longrope", 24)
    assert scaling.attention_factor == 1.25
    assert (scaling.short_factor, scaling.long_factor) == ((1.0,) * 6, (2.0,) * 6)
    plain = phi3_config_from_gguf(tmp_path / "p.gguf", {"rope.dimension_count": None}, factors={})  # Phi-3-mini-4k
    assert (plain.rotary_dim, plain.rope_scaling) == (16, None)


# (metadata changed from PHI3_METADATA, the factor tensors written (None: PHI3_FACTORS); the message)
BAD_PHI3_GGUFS = [
    (
        {"rope.dimension_count": 13},
        None,
        "metadata phi3.rope.dimension_count must be an even number from 2 to head_dim (16), got 13",
    ),
    (
        {"rope.dimension_count": 18},
        None,
        "metadata phi3.rope.dimension_count must be an even number from 2 to head_dim (16), got 18",
    ),
    (
        {},
        {"rope_factors_long.weight": [2.0] * 6},
        "tensor 'rope_factors_short.weight' is missing (LongRoPE: the file has 'rope_factors_long.weight')",
    ),
    (
        {"rope.dimension_count": 16},
        None,
        "tensor 'rope_factors_short.weight' has 6 values, expected the rotary dim / 2 = 8",
    ),
    (
        {},
        PHI3_FACTORS | {"rope_factors_long.weight": [2.0, 0.0, 2.0, 2.0, 2.0, 2.0]},
        "tensor 'rope_factors_long.weight' must hold positive finite numbers",
    ),
    (
        {"rope.scaling.original_context_length": None},
        None,
        "metadata phi3.rope.scaling.original_context_length is missing",
    ),
]


@pytest.mark.parametrize(("metadata", "factors", "message"), BAD_PHI3_GGUFS, ids=range(len(BAD_PHI3_GGUFS)))
def test_bad_phi3_gguf_is_named(tmp_path, metadata, factors, message):
    with pytest.raises(ModelLoadError) as error:
        phi3_config_from_gguf(tmp_path / "m.gguf", metadata, factors)
    assert str(error.value) == f"{tmp_path / 'm.gguf'}: {message}"


# ----- the default model, SmolLM2-135M-Instruct (Q8_0 embeddings, Q4_1 layers) -----

PROMPTS = PARITY_PROMPTS


def test_smollm2_tensors_equal_transformers_gguf_loader(smollm2_path, smollm2_hf):
    config, params = load_gguf(smollm2_path, np.float32)
    reference = {name: t.numpy() for name, t in smollm2_hf.state_dict().items()}
    for suffix, path, _, convert in layer_tensor_specs(config):
        ours = params["layers"]
        for key in path:
            ours = ours[key]
        for layer in range(config.num_layers):
            np.testing.assert_array_equal(
                ours[layer], convert(reference[f"model.layers.{layer}.{suffix}"]), err_msg=f"layer {layer} {suffix}"
            )
    np.testing.assert_array_equal(params["embed_tokens"]["embedding"], reference["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["norm"]["scale"], reference["model.norm.weight"])
    assert "lm_head" not in params and config.tie_word_embeddings


def test_smollm2_logits_match_transformers(smollm2_path, smollm2_hf):
    config, params = load_model(smollm2_path)
    tokenizer = load_tokenizer(smollm2_path)
    for prompt in PROMPTS:
        ids = encode_prompt(tokenizer, prompt)
        ours = np.asarray(forward(config, params, [ids]))[0]
        with torch.no_grad():
            reference = smollm2_hf(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(ours, reference, atol=1e-3, rtol=0, err_msg=prompt)
        np.testing.assert_array_equal(ours.argmax(-1), reference.argmax(-1), err_msg=prompt)


def test_smollm2_tokenizer_and_chat_template(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAGE_CACHE", str(tmp_path))
    built = load_tokenizer(smollm2_path)  # from the GGUF metadata, then cached
    assert len(list((tmp_path / "gguf-tokenizers").iterdir())) == 1
    cached = load_tokenizer(smollm2_path)
    texts = ["The capital of France is", "naïve café — 東京 🙂", "<|im_start|>user\nx<|im_end|>", "  spaces\n\ttab"]
    for tokenizer in (built, cached):
        assert tokenizer.decode(encode_prompt(tokenizer, texts[0])) == texts[0]
        chat = tokenizer.decode(encode_prompt(tokenizer, "Hi!", chat=True))
        assert chat.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    for text in texts:
        assert encode_prompt(cached, text) == encode_prompt(built, text)
        assert encode_prompt(cached, text, chat=True) == encode_prompt(built, text, chat=True)
