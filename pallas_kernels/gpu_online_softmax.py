"""The online softmax (flash attention) step shared by the GPU kernels: one kv tile (a few pages) at a time."""

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


def attend_pages(q, k_ref, v_ref, page_ids, key_pos, kv_len, visible, state, *, sm_scale, soft_cap):
    """Folds one kv tile of pages into the state.

    q [rows, head_dim] float32; k_ref, v_ref [total_pages, page_size, head_dim]; page_ids [pages]; key_pos
    [pages * page_size] the positions they hold; visible [rows or 1, pages * page_size] which keys each row sees
    (all of them < kv_len)."""
    kv_tile, head_dim = key_pos.shape[0], k_ref.shape[-1]
    acc, row_max, row_sum = state
    in_cache = (key_pos < kv_len)[:, None]
    # Zeroed, not only masked: NaN in a stale slot times a zero probability is still NaN.
    keys = jnp.where(in_cache, k_ref[page_ids].reshape(kv_tile, head_dim).astype(jnp.float32), 0.0)
    values = jnp.where(in_cache, v_ref[page_ids].reshape(kv_tile, head_dim).astype(jnp.float32), 0.0)
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
