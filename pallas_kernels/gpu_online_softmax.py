"""The online softmax (flash attention) step shared by the GPU kernels: one kv tile (a few pages) at a time.

The tile's pages are gathered through the block table and widened to float32; 8-bit pages (int8, fp8; see
`pallas_kernels.kv_quantization`) are multiplied by their per-token scales as they are gathered, so the pool is
read in 8 bits and never dequantized as a whole."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.impl import MASK_VALUE

MIN_DOT_ROWS = 16  # Triton's dot needs at least 16 rows


def initial_state(rows: int, head_dim: int):
    """(accumulator [rows, head_dim], row max [rows], row sum [rows]) before any key."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def _gather_tile(ref, scale_ref, page_ids, in_cache):
    """The kv tile [kv_tile, head_dim] float32 of `ref`'s pages `page_ids`, times their per-token scales where
    scale_ref [total_pages, page_size] is given (8-bit pages), zero where in_cache [kv_tile, 1] is False."""
    kv_tile, head_dim = in_cache.shape[0], ref.shape[-1]
    tile = ref[page_ids].reshape(kv_tile, head_dim).astype(jnp.float32)
    if scale_ref is not None:
        tile = tile * scale_ref[page_ids].reshape(kv_tile, 1).astype(jnp.float32)
    # Zeroed after scaling, not only masked: a stale slot's value or scale may be NaN, and NaN times a zero
    # probability is still NaN.
    return jnp.where(in_cache, tile, 0.0)


def attend_pages(q, k_ref, v_ref, scale_refs, page_ids, key_pos, kv_len, visible, state, *, sm_scale, soft_cap):
    """Folds one kv tile of pages into the state.

    q [rows, head_dim] float32; k_ref, v_ref [total_pages, page_size, head_dim]; scale_refs: with 8-bit pages
    their (k_scale_ref, v_scale_ref) [total_pages, page_size], else (); page_ids [pages]; key_pos
    [pages * page_size] the positions they hold; visible [rows or 1, pages * page_size] which keys each row sees
    (all of them < kv_len)."""
    k_scale_ref, v_scale_ref = scale_refs or (None, None)
    acc, row_max, row_sum = state
    in_cache = (key_pos < kv_len)[:, None]
    keys = _gather_tile(k_ref, k_scale_ref, page_ids, in_cache)
    values = _gather_tile(v_ref, v_scale_ref, page_ids, in_cache)
    logits = plgpu.dot(q, keys, trans_b=True, allow_tf32=False) * sm_scale  # [rows, kv_tile]
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(visible, logits, MASK_VALUE)
    new_max = jnp.maximum(row_max, logits.max(axis=1))
    alpha = jnp.exp(row_max - new_max)
    p = jnp.where(visible, jnp.exp(logits - new_max[:, None]), 0.0)
    acc = alpha[:, None] * acc + plgpu.dot(p, values, allow_tf32=False)
    return acc, new_max, alpha * row_sum + p.sum(axis=1)


def normalized(state):
    """The accumulator divided by the row sums; rows that saw no key give 0."""
    acc, _, row_sum = state
    return acc / jnp.where(row_sum > 0, row_sum, 1.0)[:, None]
