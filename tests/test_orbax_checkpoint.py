"""`jaxpage convert` and orbax checkpoints: an exact round trip, restored onto the target device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_FAMILIES

from jaxpage.entrypoints.cli import main
from jaxpage.models import load_model
from jaxpage.models.orbax_checkpoint import save_checkpoint

FAMILY = next(f for f in TINY_FAMILIES if f.name == "qwen3-qk-norm-head-dim")


# Each family's config fields (per-layer types and RoPE bases, LongRoPE's factors, experts) and parameter tree.
ROUND_TRIP_FAMILIES = [
    f
    for f in TINY_FAMILIES
    if f.name in ("qwen3-qk-norm-head-dim", "gemma3-qk-norm-local-rope", "qwen2-moe-shared-expert", "phi3-longrope")
]


@pytest.mark.parametrize("family", ROUND_TRIP_FAMILIES, ids=lambda f: f.name)
def test_round_trip_gives_identical_parameters(family, tiny_model_path, tmp_path):
    config, params = load_model(tiny_model_path(family))
    save_checkpoint(tmp_path / "ckpt", config, params)

    device = jax.devices()[0]
    restored_config, restored = load_model(tmp_path / "ckpt", sharding=jax.sharding.SingleDeviceSharding(device))

    assert restored_config == config
    assert jax.tree.structure(restored) == jax.tree.structure(params)
    for ours, theirs in zip(jax.tree.leaves(params), jax.tree.leaves(restored), strict=True):
        assert isinstance(theirs, jax.Array) and theirs.devices() == {device}
        assert theirs.dtype == ours.dtype
        np.testing.assert_array_equal(np.asarray(theirs), np.asarray(ours))


def test_restore_casts_to_the_requested_dtype(tiny_model_dir, tmp_path):
    config, params = load_model(tiny_model_dir(FAMILY)[0])
    save_checkpoint(tmp_path / "ckpt", config, params)
    _, restored = load_model(tmp_path / "ckpt", dtype="bfloat16")
    for ours, theirs in zip(jax.tree.leaves(params), jax.tree.leaves(restored), strict=True):
        assert theirs.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(theirs), np.asarray(ours.astype(jnp.bfloat16)))


def test_convert_command_writes_a_loadable_checkpoint_with_tokenizer(smollm2_path, tmp_path):
    assert main(["convert", str(smollm2_path), str(tmp_path / "smollm2")]) == 0
    config, params = load_model(smollm2_path)
    restored_config, restored = load_model(tmp_path / "smollm2")
    assert restored_config == config
    for ours, theirs in zip(jax.tree.leaves(params), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(theirs), np.asarray(ours))

    from jaxpage.tokenizers.tokenizer import encode_prompt, load_tokenizer

    assert encode_prompt(load_tokenizer(tmp_path / "smollm2"), "Hi!", chat=True) == encode_prompt(
        load_tokenizer(smollm2_path), "Hi!", chat=True
    )
    # A second convert into the same place refuses instead of overwriting.
    assert main(["convert", str(smollm2_path), str(tmp_path / "smollm2")]) == 2
