"""jaxpage's cache-free forward against transformers' PyTorch models, family by family."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_FAMILIES, hf_logits

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


def test_sliding_window_changes_the_result(tiny_model_dir):
    """Guards the Mistral case above against passing vacuously: the window must matter at these lengths."""
    import dataclasses

    family = next(f for f in TINY_FAMILIES if f.name == "mistral-sliding-window")
    config, params = load_model(tiny_model_dir(family)[0])
    tokens = np.arange(20, dtype=np.int32)[None] % config.vocab_size
    windowed = np.asarray(forward(config, params, tokens))
    full = np.asarray(forward(dataclasses.replace(config, sliding_window=None), params, tokens))
    np.testing.assert_allclose(windowed[0, :5], full[0, :5], atol=1e-5)
    assert np.abs(windowed[0, 5:] - full[0, 5:]).max() > 1e-2


def test_forward_rejects_bad_shapes(tiny_model_dir):
    config, params = load_model(tiny_model_dir(TINY_FAMILIES[0])[0])
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


def test_sharded_safetensors_directory_loads_the_same_parameters(tiny_model_dir, tmp_path):
    directory, hf_model = tiny_model_dir(TINY_FAMILIES[0])
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    _, whole = load_model(directory)
    _, sharded = load_model(tmp_path)
    assert jax.tree.structure(sharded) == jax.tree.structure(whole)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(sharded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
