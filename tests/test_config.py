"""ModelConfig from HF configs, RoPE frequencies against transformers, the parameter tree's shape, engine arguments."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import transformers
from conftest import TINY_COMMON_CONFIG, TINY_FAMILIES
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxpage.config import EngineConfig, ModelConfig, RopeScaling, model_config_from_hf
from jaxpage.models import load_model, param_shapes
from jaxpage.models.rope import inverse_frequencies


def hf_config(family):
    return getattr(transformers, family.config_class)(**{**TINY_COMMON_CONFIG, **family.kwargs})


@pytest.mark.parametrize("family", TINY_FAMILIES, ids=lambda f: f.name)
def test_rope_frequencies_equal_transformers(family):
    hf = hf_config(family)
    config = model_config_from_hf(hf.to_dict())
    ours = inverse_frequencies(config)
    if "full_attention" in hf.rope_parameters:  # Gemma 3: the global layers' (scaled), and the sliding layers' base
        reference, _ = ROPE_INIT_FUNCTIONS[hf.rope_parameters["full_attention"]["rope_type"]](
            hf, layer_type="full_attention"
        )
        np.testing.assert_allclose(ours, reference.numpy(), rtol=1e-6, atol=0)
        local = dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)
        rotary = transformers.AutoModelForCausalLM.from_config(hf).model.rotary_emb
        reference, _ = rotary.compute_default_rope_parameters(hf, layer_type="sliding_attention")
        np.testing.assert_allclose(inverse_frequencies(local), reference.numpy(), rtol=1e-6, atol=0)
        return
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":
        rotary = transformers.AutoModelForCausalLM.from_config(hf).model.rotary_emb
        reference, scale = rotary.compute_default_rope_parameters(hf)
    else:
        reference, scale = ROPE_INIT_FUNCTIONS[rope_type](hf)
    # LongRoPE's attention factor multiplies cos and sin; the other types have none
    assert scale == pytest.approx(config.rope_scaling.attention_factor if rope_type == "longrope" else 1.0, rel=1e-12)
    np.testing.assert_allclose(ours, reference.numpy(), rtol=1e-6, atol=0)
    if rope_type == "longrope":  # the long factors' frequencies: transformers' past original_max_position_embeddings
        original = config.rope_scaling.original_max_position_embeddings
        long_reference, _ = ROPE_INIT_FUNCTIONS[rope_type](hf, seq_len=original + 1)
        np.testing.assert_allclose(inverse_frequencies(config, long=True), long_reference.numpy(), rtol=1e-6, atol=0)


def test_llama3_scaling_keeps_high_and_divides_low_frequencies():
    scaling = RopeScaling(
        "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    config = model_config_from_hf(hf_config(TINY_FAMILIES[0]).to_dict())
    config = dataclasses.replace(config, head_dim=128, rope_theta=500000.0, rope_scaling=scaling)
    plain = inverse_frequencies(dataclasses.replace(config, rope_scaling=None))
    scaled = inverse_frequencies(config)
    assert scaled[0] == plain[0]  # wavelength 2*pi, far below 8192 / 4: kept
    np.testing.assert_allclose(scaled[-1], plain[-1] / 8.0, rtol=1e-6)  # wavelength above 8192: divided


def test_smollm2_like_config_and_kv_size():
    config = model_config_from_hf(
        dict(
            model_type="llama",
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            rope_theta=100000.0,
            tie_word_embeddings=True,
            eos_token_id=2,
            bos_token_id=1,
        )
    )
    assert (config.head_dim, config.num_queries_per_kv, config.eos_token_ids) == (64, 3, (2,))
    # 2 (K and V) * 30 layers * 3 kv heads * 64 dims * 4 bytes
    assert config.kv_bytes_per_token(dtype_bytes=4) == 46080
    assert config.kv_bytes_per_token(dtype_bytes=2) == 23040


def test_config_json_round_trip():
    for family in TINY_FAMILIES:
        config = model_config_from_hf(hf_config(family).to_dict())
        assert ModelConfig.from_json(config.to_json()) == config
        hash(config)  # a static jit argument must be hashable


@pytest.mark.parametrize("family", TINY_FAMILIES, ids=lambda f: f.name)
def test_param_shapes_describe_loaded_parameters(family, tiny_model_dir):
    config, params = load_model(tiny_model_dir(family)[0])
    shapes = param_shapes(config, "float32")
    assert jax.tree.structure(shapes) == jax.tree.structure(params)
    for expected, actual in zip(jax.tree.leaves(shapes), jax.tree.leaves(params), strict=True):
        assert (expected.shape, expected.dtype) == (actual.shape, actual.dtype)


@pytest.mark.parametrize(
    ("engine_args", "field"),
    [
        (dict(page_size=0), "page_size"),
        (dict(max_num_seqs=2.5), "max_num_seqs"),
        (dict(max_model_len=1), "max_model_len"),
        (dict(num_pages=1), "num_pages"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(dtype="float64"), "dtype"),
        (dict(attention_impl="triton"), "attention_impl"),
    ],
)
def test_bad_engine_arguments_name_the_field(engine_args, field):
    with pytest.raises(ValueError, match=f"engine argument {field} must be"):
        EngineConfig(**engine_args)


def test_engine_arguments_accept_every_attention_impl():
    assert [EngineConfig(attention_impl=impl).attention_impl for impl in EngineConfig.ATTENTION_IMPLS] == list(
        EngineConfig.ATTENTION_IMPLS
    )
