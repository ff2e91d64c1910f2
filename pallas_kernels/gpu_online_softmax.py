"""The online softmax (flash attention) step shared by the GPU kernels: one kv tile (a few pages) at a time.

The tile's pages are gathered through the block table and widened to float32; 8-bit pages (int8, fp8; see
`pallas_kernels.kv_quantization`) are multiplied by their per-token scales as they are gathered, so the pool is
read in 8 bits and never dequantized as a whole."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.impl import MASK_VALUE, triton_misaddresses

MIN_DOT_ROWS = 16  # Triton's dot needs at least 16 rows
# Bytes of one K (or V) tile as the pool stores it, at most. Triton pipelines the loop's loads over 3 stages (the
# Triton lowering's default), 2 tiles of K and 2 of V in flight in shared memory: 128 KiB of the 227 KiB an
# H100 / H200 block may use. Llama-3-8B's float32 tile of 128 keys x 128 dims (64 KiB) asked for 264 KiB.
MAX_KV_TILE_BYTES = 32 << 10


def kv_step_pages(pages_per_kv_tile: int, page_size: int, head_dim: int, itemsize: int) -> int:
    """Pages a kernel reads per step: pages_per_kv_tile, halved (while even: a divisor of it, so the tables' padding
    holds whole steps) while a tile of the pool's values would take more than MAX_KV_TILE_BYTES."""
    pages = pages_per_kv_tile
    while pages % 2 == 0 and pages * page_size * head_dim * itemsize > MAX_KV_TILE_BYTES:
        pages //= 2
    return pages


def check_pool_offsets(k_pages) -> None:
    """ValueError for a pool the Triton lowering would address wrongly. It computes element offsets in int32 unless
    the array takes more than 4 GiB, and Triton adds int32 offsets signed: a 1-byte pool of (2, 4] GiB has offsets
    past 2**31 that wrap negative (2- and 4-byte pools stay below 2**31 elements there)."""
    nbytes = k_pages.size * k_pages.dtype.itemsize
    if triton_misaddresses(nbytes, k_pages.dtype.itemsize):
        raise ValueError(
            f"the GPU kernels cannot address an 8-bit KV pool of {nbytes} bytes per K / V array ({k_pages.dtype}"
            f"{list(k_pages.shape)}): between 2 GiB and 4 GiB the Triton lowering's int32 offsets overflow; take "
            "fewer pages (at most 2 GiB) or more (over 4 GiB)"
        )


def cost_estimate(
    *, pairs: int, keys_read: int, head_dim: int, kv_itemsize: int, scale_itemsize: int, soft_cap, other_bytes: int
) -> pl.CostEstimate:
    """An upper bound of a kernel call's work: `pairs` (query row, key) products of head_dim -- two matmuls, the
    exponential (and the soft cap's tanh) of each logit -- and `keys_read` keys of K and V read (with their scales:
    scale_itemsize 0 without), plus other_bytes (queries, tables, outputs)."""
    key_bytes = 2 * (head_dim * kv_itemsize + scale_itemsize)  # K and V
    return pl.CostEstimate(
        flops=4 * pairs * head_dim,
        transcendentals=pairs * (1 if soft_cap is None else 2),
        bytes_accessed=keys_read * key_bytes + other_bytes,
    )


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
