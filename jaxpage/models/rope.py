"""Rotary position embeddings in the Hugging Face ("rotate half") layout, with linear, Llama-3 and LongRoPE scaling,
over the whole head or its first `rotary_dim` dimensions (Phi-3's partial rotary factor)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxpage.config import ModelConfig


def inverse_frequencies(config: ModelConfig, long: bool = False) -> np.ndarray:
    """The `rotary_dim // 2` rotation frequencies, float32, computed as transformers computes them (LongRoPE: with
    its short factors, or with `long` its long ones)."""
    dim = config.rotary_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    if config.rope_scaling is not None and config.rope_scaling.rope_type == "longrope":
        scaling = config.rope_scaling
        factors = np.asarray(scaling.long_factor if long else scaling.short_factor, np.float32)
        return (np.float32(1.0) / (factors * np.power(np.float32(config.rope_theta), exponents))).astype(np.float32)
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
    """cos and sin for `positions` (int32 [...]), each float32 [..., rotary_dim // 2]."""
    if config.rope_scaling is not None and config.rope_scaling.rope_type == "longrope":
        return _longrope_tables(config, positions)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inverse_frequencies(config))
    return jnp.cos(angles), jnp.sin(angles)


def _longrope_tables(config: ModelConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """LongRoPE's cos and sin, times its attention factor: the short factors' frequencies at positions below
    original_max_position_embeddings, the long factors' from it on.

    transformers picks one set for a whole forward pass by the sequence length so far (the longest in its batch):
    the short factors while it is at most original_max_position_embeddings, the long ones for every position once it
    is longer. jaxpage's tables are per position (a paged KV cache keeps the keys rotated as they were written), so it
    equals transformers for every sequence up to original_max_position_embeddings tokens, and past it equals
    transformers fed the first original_max_position_embeddings tokens, then the rest, with its KV cache (the keys it
    cached before the switch keep their short-factor rotation there too); it is not transformers' one-pass prefill
    of a longer prompt, which re-rotates the first positions with the long factors."""
    scaling = config.rope_scaling
    long = (positions >= scaling.original_max_position_embeddings)[..., None]
    short_freq = jnp.asarray(inverse_frequencies(config))
    long_freq = jnp.asarray(inverse_frequencies(config, long=True))
    angles = positions.astype(jnp.float32)[..., None] * jnp.where(long, long_freq, short_freq)
    factor = jnp.float32(scaling.attention_factor)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates `x` [..., heads, head_dim] by the angles of cos/sin [..., rotary_dim // 2]: its first rotary_dim
    dimensions in the rotate-half layout, the rest (a partial rotary factor's) unchanged."""
    rotary = 2 * cos.shape[-1]
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], axis=-1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
