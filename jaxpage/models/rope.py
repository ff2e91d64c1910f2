"""Rotary position embeddings in the Hugging Face ("rotate half") layout, with linear and Llama-3 scaling."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxpage.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """The `head_dim // 2` rotation frequencies, float32, computed as transformers computes them."""
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(config.rope_theta), exponents)).astype(np.float32)
    inv_freq = _scaled(inv_freq, config)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / np.asarray(config.rope_freq_factors, np.float32)
    return inv_freq.astype(np.float32)


def _scaled(inv_freq: np.ndarray, config: ModelConfig) -> np.ndarray:
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / np.float32(scaling.factor)
    # Llama 3: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)


def rope_tables(config: ModelConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin for `positions` (int32 [...]), each float32 [..., head_dim // 2]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inverse_frequencies(config))
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates `x` [..., heads, head_dim] by the angles of cos/sin [..., head_dim // 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
