"""The online softmax (flash attention) step shared by the GPU kernels: one kv tile (a few pages) at a time.

The products run on the tensor cores in the query's dtype: the tile's pages are gathered through the block table in
the pool's dtype and, for 8-bit pages (int8, fp8; see `pallas_kernels.kv_quantization`), widened to the query's
dtype (exact: bfloat16 holds every int8 and fp8 value); their per-token scales multiply the logits' columns (K) and
the probabilities (V), never the tile's elements. Only the logits, the softmax statistics and the accumulator are
float32. A float32 query (a float32 model) makes float32 products (`allow_tf32=False`: scalar FMAs, no TF32).

The tiles' sizes come from the compiled kernels' resources (registers, shared memory, resident blocks; see
`scripts/compile_for.py --target gpu-h200`): a kv tile holds at most MAX_KV_TILE_BYTES in the products' dtype."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.impl import MASK_VALUE, triton_misaddresses

MIN_DOT_ROWS = 16  # the tensor cores' (and Triton's dot's) smallest number of rows
# Bytes of one K (or V) tile in the products' dtype, at most: 64 keys x 128 dims of bfloat16, 128 x 64. Triton
# pipelines the loop's loads over 3 stages and stages the dot operands in shared memory: with 16 KiB tiles a bfloat16
# decode block of Llama-3-8B's shape takes 54 KiB of the 228 KiB an H100 / H200 SM has and ~124 registers a thread,
# so 4 blocks are resident per SM (compile_for's kernel report; 32 KiB tiles of float32 took 200 KiB: 1 block).
MAX_KV_TILE_BYTES = 16 << 10
F32_DOT_COLUMNS = 16  # head_dim columns of one float32 product of the logits (`load_query`)


def kv_step_pages(pages_per_kv_tile: int, page_size: int, head_dim: int, itemsize: int) -> int:
    """Pages a kernel reads per step: pages_per_kv_tile, halved (while even: a divisor of it, so the tables' padding
    holds whole steps) while a tile of itemsize-byte values (the products' dtype) would take more than
    MAX_KV_TILE_BYTES."""
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


def load_query(q_ref, rows=slice(None)):
    """The query rows `rows` of q_ref [rows, head_dim] as `attend_pages` takes them: whole in a 16-bit dtype
    (tensor-core products); float32 in chunks of F32_DOT_COLUMNS columns, a tuple (a scalar product holds its
    operands' whole contraction in each thread: 128 float32 columns of q and of K did not fit in registers)."""
    if q_ref.dtype != jnp.float32:
        return q_ref[rows, :]
    head_dim = q_ref.shape[-1]
    columns = math.gcd(head_dim, F32_DOT_COLUMNS)  # head_dim 8: one chunk of 8
    return tuple(q_ref[rows, pl.ds(c, columns)] for c in range(0, head_dim, columns))


def _gather_tile(ref, page_ids, dtype, columns=slice(None)):
    """The kv tile [pages * page_size, columns] of `ref`'s pages `page_ids` [pages], in `dtype`."""
    tile = ref[page_ids, :, columns]
    return tile.reshape(tile.shape[0] * tile.shape[1], tile.shape[2]).astype(dtype)


def _gather_scales(scale_ref, page_ids):
    """The per-token scales [pages * page_size] float32 of `scale_ref`'s pages `page_ids` [pages]."""
    scales = scale_ref[page_ids]
    return scales.reshape(scales.shape[0] * scales.shape[1]).astype(jnp.float32)


def _dot(a, b, *, trans_b=False):
    """a @ b (or b's transpose): on the tensor cores for 16-bit operands, scalar float32 for float32 ones (no TF32)."""
    return plgpu.dot(a, b, trans_b=trans_b, allow_tf32=False if a.dtype == jnp.float32 else None)


def attend_pages(q, k_ref, v_ref, scale_refs, page_ids, key_pos, kv_len, visible, state, *, sm_scale, soft_cap):
    """Folds one kv tile of pages into the state.

    q [rows, head_dim] as `load_query` gives it; k_ref, v_ref [total_pages, page_size, head_dim];
    scale_refs: with 8-bit pages their (k_scale_ref, v_scale_ref) [total_pages, page_size], else (); page_ids
    [pages]; key_pos [pages * page_size] the positions they hold; visible [rows or 1, pages * page_size] which keys
    each row sees (all of them < kv_len).

    Keys at positions >= kv_len may hold anything, NaN included (stale slots, and their scales): their logits are
    replaced (not multiplied) by the mask, and their values and value scales are zeroed, since a zero probability
    times NaN is still NaN."""
    acc, row_max, row_sum = state
    in_cache = key_pos < kv_len  # [kv_tile]
    if isinstance(q, tuple):  # float32, in column chunks (`load_query`)
        dtype, columns = jnp.float32, q[0].shape[1]
        chunks = [_gather_tile(k_ref, page_ids, dtype, pl.ds(i * columns, columns)) for i in range(len(q))]
        logits = sum(_dot(q_chunk, k_chunk, trans_b=True) for q_chunk, k_chunk in zip(q, chunks, strict=True))
    else:
        dtype = q.dtype
        logits = _dot(q, _gather_tile(k_ref, page_ids, dtype), trans_b=True)  # [rows, kv_tile] float32
    values = jnp.where(in_cache[:, None], _gather_tile(v_ref, page_ids, dtype), 0)
    if scale_refs:
        k_scale_ref, v_scale_ref = scale_refs
        logits = logits * (sm_scale * _gather_scales(k_scale_ref, page_ids))[None, :]
    else:
        logits = logits * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(visible, logits, MASK_VALUE)
    new_max = jnp.maximum(row_max, logits.max(axis=1))
    alpha = jnp.exp(row_max - new_max)
    p = jnp.where(visible, jnp.exp(logits - new_max[:, None]), 0.0)
    row_sum = alpha * row_sum + p.sum(axis=1)
    if scale_refs:
        p = p * jnp.where(in_cache, _gather_scales(v_scale_ref, page_ids), 0.0)[None, :]
    acc = alpha[:, None] * acc + _dot(p.astype(dtype), values)
    return acc, new_max, row_sum


def normalized(state):
    """The accumulator divided by the row sums; rows that saw no key give 0."""
    acc, _, row_sum = state
    return acc / jnp.where(row_sum > 0, row_sum, 1.0)[:, None]
