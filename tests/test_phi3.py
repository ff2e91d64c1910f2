"""Phi-3, Phi-3.5 and Phi-4-mini (model_type "phi3"): LongRoPE's per-position switch from the short factors to the
long ones, the partial rotary factor, config.json's layouts, and the fused qkv/gate_up weights through tensor
parallelism and int8. (Logits and engine greedy against transformers for the tiny families: test_model_parity.py,
test_model_families.py.)"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from hf_reference import TINY_FAMILIES, hf_logits, hf_logits_split
from test_int8 import dequantized
from tiny_models import TINY_COMMON_CONFIG, tiny_config

from jaxpage.config import ModelConfig, model_config_from_hf
from jaxpage.entrypoints.llm import LLM
from jaxpage.models import forward, load_model
from jaxpage.models.rope import apply_rope, rope_tables
from jaxpage.sampling_params import SamplingParams

PHI3 = next(f for f in TINY_FAMILIES if f.name == "phi3-longrope")
PHI4_MINI = next(f for f in TINY_FAMILIES if f.name == "phi4-mini-partial-rotary")


def test_longrope_tables_use_the_long_factors_from_original_max_position_embeddings():
    config = model_config_from_hf(tiny_config(PHI3))
    scaling = config.rope_scaling
    original, kwargs = 32, PHI3.kwargs["rope_scaling"]
    assert (scaling.rope_type, scaling.original_max_position_embeddings) == ("longrope", original)
    # factor = max_position_embeddings / original_max_position_embeddings = 8
    assert scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(256 / 32) / math.log(32)), rel=1e-12)
    positions = np.array([0, 1, 17, 31, 32, 33, 100, 255])

    # The formula: frequency i = 1 / (factor_i * theta ** (2i / dim)), factor_i short below `original`, long from it.
    dim = config.head_dim
    base = 10000.0 ** (np.arange(0, dim, 2) / dim)
    short, long = 1 / (np.array(kwargs["short_factor"]) * base), 1 / (np.array(kwargs["long_factor"]) * base)
    angles = positions[:, None] * np.where(positions[:, None] < original, short, long)
    cos, sin = rope_tables(config, jnp.asarray(positions, jnp.int32))
    np.testing.assert_allclose(np.asarray(cos), np.cos(angles) * scaling.attention_factor, rtol=0, atol=5e-5)
    np.testing.assert_allclose(np.asarray(sin), np.sin(angles) * scaling.attention_factor, rtol=0, atol=5e-5)
    short_angles = positions[:, None] * short  # what the short factors alone would give: far off past the switch
    assert np.abs(np.asarray(cos)[4:] - np.cos(short_angles[4:]) * scaling.attention_factor).max() > 0.1


def test_partial_rotary_factor_rotates_the_first_dimensions_only():
    config = model_config_from_hf(tiny_config(PHI4_MINI))
    assert (config.head_dim, config.rotary_dim, config.partial_rotary_factor) == (16, 12, 0.75)
    cos, sin = rope_tables(config, jnp.arange(5, dtype=jnp.int32))
    assert cos.shape == sin.shape == (5, 6)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 2, 16)), jnp.float32)  # [tokens, heads, head_dim]
    rotated = np.asarray(apply_rope(x, cos, sin))
    np.testing.assert_array_equal(rotated[..., 12:], np.asarray(x)[..., 12:])
    np.testing.assert_array_equal(rotated[..., :12], np.asarray(apply_rope(x[..., :12], cos, sin)))


@pytest.mark.parametrize("family", [PHI3, PHI4_MINI], ids=lambda f: f.name)
def test_logits_past_the_switch_equal_transformers_fed_in_two_pieces(family, tiny_model_dir):
    """Past original_max_position_embeddings, jaxpage's logits are transformers' with the first
    original_max_position_embeddings tokens fed first and the rest after, with its KV cache (the rule of
    jaxpage.models.rope._longrope_tables); transformers' one-pass prefill of the whole sequence differs."""
    directory, hf_model = tiny_model_dir(family)
    config, params = load_model(directory)
    split = config.rope_scaling.original_max_position_embeddings
    prompt = np.random.default_rng(2).integers(0, config.vocab_size, split + 18).tolist()
    ours = np.asarray(forward(config, params, [prompt]))[0]
    np.testing.assert_allclose(ours, hf_logits_split(hf_model, prompt, split), atol=1e-4, rtol=0)
    assert np.abs(ours - hf_logits(hf_model, prompt)).max() > 1e-2


def test_config_json_layouts_read_as_transformers_reads_them():
    """Phi-4-mini's config.json layout (partial_rotary_factor and original_max_position_embeddings at the top level,
    rope_scaling with "type") means what transformers' Phi3Config makes of it, and the same model as transformers 5's
    layout (rope_parameters); Phi-3's older "su" is longrope; original_max_position_embeddings defaults to 4096."""
    rope = {
        k: v for k, v in PHI4_MINI.kwargs["rope_parameters"].items() if k not in ("rope_type", "partial_rotary_factor")
    }
    hub = PHI4_MINI.kwargs | dict(partial_rotary_factor=0.75, rope_scaling=dict(type="longrope", **rope))
    del hub["rope_parameters"]
    ours = model_config_from_hf(tiny_config(dataclasses.replace(PHI4_MINI, kwargs=hub)))
    assert ours == model_config_from_hf(tiny_config(PHI4_MINI))
    assert ours == model_config_from_hf(transformers.Phi3Config(**TINY_COMMON_CONFIG, **hub).to_dict())
    su = dict(hub, rope_scaling=dict(hub["rope_scaling"], type="su"))
    assert model_config_from_hf(tiny_config(dataclasses.replace(PHI4_MINI, kwargs=su))) == ours
    del hub["original_max_position_embeddings"]
    default = model_config_from_hf(tiny_config(dataclasses.replace(PHI4_MINI, kwargs=hub)))
    assert default.rope_scaling.original_max_position_embeddings == 4096
    assert default.rope_scaling.attention_factor == 1.0  # max_position_embeddings 256 / 4096: no scaling
    assert ModelConfig.from_json(ours.to_json()) == ours


def test_fused_weights_through_tensor_parallelism_and_int8(tiny_model_path):
    """q/k/v and gate/up split out of the fused tensors load into Llama's tree: split over 2 devices the engine's
    greedy tokens are one device's, and int8 quantizes them as a Llama's (the model equals its dequantized twin)."""
    directory = str(tiny_model_path(PHI4_MINI))
    args = dict(skip_tokenizer_init=True, max_model_len=64, max_num_seqs=4, page_size=4, num_pages=64)
    prompts = [{"prompt_token_ids": [(3 * i + j) % 90 + 2 for j in range(5 + 9 * i)]} for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def tokens(**extra):
        return [o.outputs[0].token_ids for o in LLM(directory, **args, **extra).generate(prompts, greedy)]

    assert tokens(tensor_parallel_size=2) == tokens()
    config, params = load_model(directory, quantization="int8")
    assert params["layers"]["attn"]["k_proj"]["kernel"].dtype == np.int8
    assert params["layers"]["mlp"]["up_proj"]["kernel"].dtype == np.int8
    prompt = [[5, 9, 13, 2, 70, 41, 8, 8, 3] * 4]  # past the tiny Phi-4-mini's switch (24)
    got, want = np.asarray(forward(config, params, prompt)), np.asarray(forward(*dequantized(config, params), prompt))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
