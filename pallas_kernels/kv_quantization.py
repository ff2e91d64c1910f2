"""8-bit KV pages: one scale per token per KV head, stored beside the pages, applied by whatever reads them.

    pages  [..., page_size, num_kv_heads, head_dim]  int8, float8_e4m3fn or float8_e5m2
    scales [..., page_size, num_kv_heads]             bfloat16

A token's K (or V) vector of one KV head is `pages[...] * scales[...]`: symmetric, absmax / the format's largest
value. Per token, not per tensor: a token's scale is fixed when it is written, and never depends on tokens
written later (a static per-tensor scale would have to be calibrated; a running one would rescale the pool).

The scale is bfloat16 (2 bytes per token per KV head, not 4): with SmolLM2's head_dim 64 that is 66 bytes where
float32 K/V take 256 -- 3.88x as many tokens in the same bytes (float32 scales would give 3.76x). The values are
divided by the bfloat16-rounded scale itself, so rounding the scale costs nothing but a slightly different grid;
the one value that could round past the format's range is clipped.

Readers dequantize the tiles they fetch (`dequantize`), never the pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# What each quantized page format's largest finite value is: the scale maps a token's absmax to it.
QUANTIZED_KV_DTYPES = {
    jnp.dtype(jnp.int8): 127.0,
    jnp.dtype(jnp.float8_e4m3fn): float(jnp.finfo(jnp.float8_e4m3fn).max),  # 448
    jnp.dtype(jnp.float8_e5m2): float(jnp.finfo(jnp.float8_e5m2).max),  # 57344
}
SCALE_DTYPE = jnp.dtype(jnp.bfloat16)


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) in QUANTIZED_KV_DTYPES


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., head_dim] -> (values [..., head_dim] in `dtype`, scales [...] bfloat16); x ~= values * scales.

    A vector of zeros gets scale 0 and values 0."""
    dtype = jnp.dtype(dtype)
    largest = QUANTIZED_KV_DTYPES[dtype]
    x = x.astype(jnp.float32)
    scales = (jnp.max(jnp.abs(x), axis=-1) / largest).astype(SCALE_DTYPE)
    divisor = scales.astype(jnp.float32)[..., None]
    y = jnp.clip(jnp.where(divisor > 0, x / jnp.where(divisor > 0, divisor, 1.0), 0.0), -largest, largest)
    if jnp.issubdtype(dtype, jnp.integer):
        y = jnp.round(y)
    return y.astype(dtype), scales


def dequantize(values: jax.Array, scales: jax.Array | None, dtype=jnp.float32) -> jax.Array:
    """values [..., head_dim] times scales [...] in `dtype` (values alone, cast, when scales is None)."""
    if scales is None:
        return values.astype(dtype)
    return (values.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]).astype(dtype)
