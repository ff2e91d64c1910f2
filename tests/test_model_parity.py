"""jaxpage's cache-free forward against transformers' PyTorch models, family by family."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from hf_reference import TINY_COMMON_CONFIG, TINY_FAMILIES, hf_logits, load_tiny_hf_model
from tiny_models import tiny_config, write_tiny_model

from jaxpage.config import model_config_from_hf
from jaxpage.models import forward, load_model

LENGTHS = (9, 20, 14)  # padded to 20 in one batch: row 0 padded on the left, row 2 on the right


def padded_batch(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(map(len, prompts))
    tokens = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        start = width - len(prompt) if row == 0 else 0
        tokens[row, start : start + len(prompt)] = prompt
        mask[row, start : start + len(prompt)] = 1
    return tokens, mask


@pytest.mark.parametrize("family", TINY_FAMILIES, ids=lambda f: f.name)
def test_tiny_config_means_what_transformers_config_class_means(family):
    """The config.json write_tiny_model writes (without transformers) describes the model transformers' config
    class would: the defaults jaxpage reads are stated, not assumed."""
    theirs = getattr(transformers, family.config_class)(**{**TINY_COMMON_CONFIG, **family.kwargs}).to_dict()
    assert model_config_from_hf(tiny_config(family)) == model_config_from_hf(theirs)


@pytest.mark.parametrize("family", TINY_FAMILIES, ids=lambda f: f.name)
def test_logits_match_transformers_on_a_padded_batch(family, tiny_model_dir):
    directory, hf_model = tiny_model_dir(family)
    config, params = load_model(directory)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in LENGTHS]
    tokens, mask = padded_batch(prompts)

    logits = np.asarray(forward(config, params, tokens, attention_mask=mask))

    assert logits.shape == (*tokens.shape, config.vocab_size)
    for row, prompt in enumerate(prompts):
        ours = logits[row][mask[row].astype(bool)]
        reference = hf_logits(hf_model, prompt)
        assert np.abs(reference).max() > 1.0  # the random weights make logits that can tell errors apart
        np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0, err_msg=f"row {row}")


def test_sliding_window_changes_the_result(tiny_model_path):
    """Guards the Mistral case above against passing vacuously: the window must matter at these lengths."""
    import dataclasses

    family = next(f for f in TINY_FAMILIES if f.name == "mistral-sliding-window")
    config, params = load_model(tiny_model_path(family))
    tokens = np.arange(20, dtype=np.int32)[None] % config.vocab_size
    windowed = np.asarray(forward(config, params, tokens))
    full = np.asarray(forward(dataclasses.replace(config, sliding_window=None), params, tokens))
    np.testing.assert_allclose(windowed[0, :5], full[0, :5], atol=1e-5)
    assert np.abs(windowed[0, 5:] - full[0, 5:]).max() > 1e-2


def test_forward_rejects_bad_shapes(tiny_model_path):
    config, params = load_model(tiny_model_path(TINY_FAMILIES[0]))
    with pytest.raises(ValueError, match="token_ids must be"):
        forward(config, params, [1, 2, 3])
    with pytest.raises(ValueError, match="attention_mask shape"):
        forward(config, params, [[1, 2, 3]], attention_mask=[[1, 1]])


def test_bfloat16_parameters_stay_close_to_transformers(tiny_model_dir):
    """bfloat16 is the GPU/TPU default: same code path, activations in bf16, norms and softmax in f32."""
    directory, hf_model = tiny_model_dir(TINY_FAMILIES[1])
    config, params = load_model(directory, dtype="bfloat16")
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))
    prompt = list(range(3, 40))
    ours = np.asarray(forward(config, params, [prompt]))[0]
    reference = hf_logits(hf_model, prompt)
    scale = np.abs(reference).max()
    assert np.abs(ours - reference).max() < 0.05 * scale


def test_sharded_safetensors_directories_load_the_same_parameters(tiny_model_dir, tmp_path):
    """Shards as transformers' save_pretrained writes them, and as write_tiny_model does (test_load_errors damages
    those: transformers must read them too)."""
    directory, hf_model = tiny_model_dir(TINY_FAMILIES[0])
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    write_tiny_model(TINY_FAMILIES[0], tmp_path / "ours", max_shard_bytes=40_000)
    load_tiny_hf_model(tmp_path / "ours")  # raises unless transformers finds every tensor it expects, and no other
    _, whole = load_model(directory)
    for sharded_directory in (tmp_path / "hf", tmp_path / "ours"):
        assert (sharded_directory / "model.safetensors.index.json").is_file()
        assert len(list(sharded_directory.glob("model-*.safetensors"))) > 2
        _, sharded = load_model(sharded_directory)
        assert jax.tree.structure(sharded) == jax.tree.structure(whole)
        for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(sharded), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
