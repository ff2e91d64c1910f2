"""Decode paged attention for NVIDIA GPUs: a Pallas kernel (Triton lowering) with split-K.

One query token per sequence attends to that sequence's keys in the paged KV pool.

Why the Triton lowering and not Mosaic GPU: Mosaic GPU targets Hopper only and does not run in Pallas' generic
interpreter, so none of its code could be checked on a CPU machine. The Triton lowering runs on every NVIDIA GPU
jax supports and, with `interpret=True`, the very same kernel body runs on CPU, which is how the tests check it
against the reference. (jax marks the Triton lowering deprecated; moving to Mosaic GPU is a change of this file.)

Grid (sequence, kv head, split). A program takes the query heads of one kv head (GQA: padded to at least 16
rows, the tensor cores' smallest product) and one of `num_splits` equal slices of the sequence's block table; it
walks its pages one kv tile of `pages_per_kv_tile` pages at a time (fewer where such tiles would be larger than
`gpu_online_softmax.MAX_KV_TILE_BYTES`) -- gathering their rows through the block table, which the Triton lowering
has no scalar prefetch for, so the table is an ordinary operand -- with an online softmax in float32 and the
products on the tensor cores (`gpu_online_softmax`). Each split writes its normalized partial output with its row
max and row sum; the splits are merged outside the kernel with a log-sum-exp weighting. Splits keep the GPU busy
when the batch is small and sequences long: sequences x kv heads x splits reaches about TARGET_PROGRAMS.

What it compiles to (`python scripts/compile_for.py --target gpu-h200`, no GPU needed): for the Llama-3-8B layer
in bfloat16, 4 warps, 124 registers a thread, no stack frame, 55 KiB of shared memory (4 resident blocks per SM),
the products as mma.sync (HMMA), the pages' rows loaded by 128-bit cp.async in a 3-stage pipeline.

8-bit pages (int8, fp8; `pallas_kernels.kv_quantization`) come with per-token scales, one more pair of operands
blocked by kv head like the pages: each kv tile is read in 8 bits, widened to the query's dtype, and its scales
multiply the logits' columns and the probabilities (float pools compile without them). K/V at positions >= kv_len
never reach the result, even when they hold NaN (`gpu_online_softmax.attend_pages`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu_online_softmax import (
    MIN_DOT_ROWS,
    attend_pages,
    check_pool_offsets,
    cost_estimate,
    initial_state,
    kv_step_pages,
    load_query,
    normalized,
)

PAGES_PER_KV_TILE = 8  # pages a program reads per step, at most (128 keys at page size 16)
MAX_SPLITS = 16
# Split sequences until sequences x kv heads x splits reaches about this many programs: an H100 / H200 holds 4 decode
# blocks on each of its 132 SMs (bfloat16 at head_dim 128: 124 registers x 128 threads, 55 KiB of shared memory).
TARGET_PROGRAMS = 512


def gpu_decode_tiling(programs: int, pages_per_seq: int) -> tuple[int, int]:
    """(num_splits, pages_per_kv_tile) for `programs` (sequences x kv heads) and block tables of pages_per_seq.

    pages_per_kv_tile: PAGES_PER_KV_TILE, or fewer for short tables (a power of two). num_splits: a power of two,
    at most the kv tiles there are and MAX_SPLITS, doubled until there are about TARGET_PROGRAMS programs."""
    pages_per_kv_tile = min(PAGES_PER_KV_TILE, pl.next_power_of_2(pages_per_seq))
    kv_tiles = -(-pages_per_seq // pages_per_kv_tile)
    splits = 1
    while splits * 2 <= min(kv_tiles, MAX_SPLITS) and programs * splits < TARGET_PROGRAMS:
        splits *= 2
    return splits, pages_per_kv_tile


def _decode_kernel(
    kv_lens_ref,  # [1] int32: this sequence's kv length
    tables_ref,  # [pages_per_seq] int32: its block table (page ids into the flattened pool)
    q_ref,  # [rows, head_dim]: its query heads of this kv head, padded to `rows`
    k_ref,  # [total_pages, page_size, head_dim]: this kv head's K pool
    v_ref,  # [total_pages, page_size, head_dim]
    scale_refs,  # 8-bit pages: (k_scale_ref, v_scale_ref) [total_pages, page_size], this kv head's; else ()
    o_ref,  # [rows, head_dim] float32: this split's normalized partial output
    m_ref,  # [rows] float32: row max of the logits seen (MASK where none)
    l_ref,  # [rows] float32: row sum of exp(logits - max) (0 where none)
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_kv_tile: int,
):
    split = pl.program_id(2)
    pages_per_split = tables_ref.shape[0] // pl.num_programs(2)
    page_size, head_dim = k_ref.shape[1:]
    rows = q_ref.shape[0]
    kv_tile = pages_per_kv_tile * page_size  # keys
    kv_len = kv_lens_ref[0]
    query_pos = kv_len - 1

    first_page = split * pages_per_split
    last_page = jnp.minimum(first_page + pages_per_split, pl.cdiv(kv_len, page_size))  # exclusive
    q = load_query(q_ref)

    def kv_tile_step(j, state):
        start_page = first_page + j * pages_per_kv_tile
        page_ids = tables_ref[pl.ds(start_page, pages_per_kv_tile)]
        key_pos = start_page * page_size + jnp.arange(kv_tile)
        visible = key_pos < kv_len
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        kwargs = dict(sm_scale=sm_scale, soft_cap=soft_cap)
        return attend_pages(q, k_ref, v_ref, scale_refs, page_ids, key_pos, kv_len, visible[None, :], state, **kwargs)

    num_kv_tiles = jnp.maximum(pl.cdiv(last_page - first_page, pages_per_kv_tile), 0)
    state = lax.fori_loop(0, num_kv_tiles, kv_tile_step, initial_state(rows, head_dim))
    _, row_max, row_sum = state
    o_ref[...] = normalized(state)
    m_ref[...] = row_max
    l_ref[...] = row_sum


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "sliding_window", "num_splits", "pages_per_kv_tile", "interpret"),
)
def gpu_decode_attention(
    q: jax.Array,  # [S, num_heads, head_dim]
    k_pages: jax.Array,  # [total_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [total_pages, page_size, num_kv_heads, head_dim]
    kv_lens: jax.Array,  # [S] int32 (0 for padding rows)
    block_tables: jax.Array,  # [S, pages_per_seq] int32, page ids into k_pages / v_pages
    *,
    k_scales: jax.Array | None = None,  # [total_pages, page_size, num_kv_heads] with 8-bit pages
    v_scales: jax.Array | None = None,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    num_splits: int,
    pages_per_kv_tile: int,
    interpret: bool,
) -> jax.Array:  # [S, num_heads, head_dim] in q's dtype
    """The kernel call and the split merge. Shapes are checked by the public `paged_attention`.

    pages_per_seq must be a multiple of num_splits, and pages_per_seq // num_splits of pages_per_kv_tile. A program
    reads that many pages per step, fewer where their tile would not fit in shared memory (`kv_step_pages`)."""
    check_pool_offsets(k_pages)
    num_seqs, num_heads, head_dim = q.shape
    total_pages, page_size, num_kv_heads, _ = k_pages.shape
    pages_per_seq = block_tables.shape[1]
    group = num_heads // num_kv_heads
    rows = max(MIN_DOT_ROWS, pl.next_power_of_2(group))
    q_rows = jnp.pad(q.reshape(num_seqs, num_kv_heads, group, head_dim), ((0, 0), (0, 0), (0, rows - group), (0, 0)))

    kernel = functools.partial(
        _decode_kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        pages_per_kv_tile=kv_step_pages(pages_per_kv_tile, page_size, head_dim, q.dtype.itemsize),
    )
    pool_spec = pl.BlockSpec((total_pages, page_size, None, head_dim), lambda s, k, split: (0, 0, k, 0))
    scales = () if k_scales is None else (k_scales, v_scales)
    scale_spec = pl.BlockSpec((total_pages, page_size, None), lambda s, k, split: (0, 0, k))
    partial_shape = (num_seqs, num_kv_heads, num_splits, rows)
    # An upper bound: every row of every program against every key of the (padded) block tables.
    keys = num_seqs * num_kv_heads * pages_per_seq * page_size
    partials = math.prod(partial_shape)  # rows of partial outputs
    cost = cost_estimate(
        pairs=keys * rows,
        keys_read=keys,
        head_dim=head_dim,
        kv_itemsize=k_pages.dtype.itemsize,
        scale_itemsize=0 if k_scales is None else k_scales.dtype.itemsize,
        soft_cap=soft_cap,
        other_bytes=q_rows.nbytes + block_tables.nbytes + kv_lens.nbytes + partials * 4 * (head_dim + 2),  # 3 outputs
    )
    out, row_max, row_sum = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda s, k, split: (s,)),
            pl.BlockSpec((None, pages_per_seq), lambda s, k, split: (s, 0)),
            pl.BlockSpec((None, None, rows, head_dim), lambda s, k, split: (s, k, 0, 0)),
            pool_spec,
            pool_spec,
            tuple(scale_spec for _ in scales),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda s, k, split: (s, k, split, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, k, split: (s, k, split, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, k, split: (s, k, split, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
        ],
        # Triton, explicitly: without compiler_params jax lowers to Mosaic GPU (jax_pallas_use_mosaic_gpu's default).
        compiler_params=plgpu.CompilerParams(),
        cost_estimate=cost,
        interpret=interpret,
        name="jaxpage_gpu_decode_attention",
    )(kv_lens, block_tables, q_rows, k_pages, v_pages, scales)

    # Log-sum-exp merge of the splits: weight each by exp(its max - the overall max) times its row sum.
    overall_max = row_max.max(axis=2, keepdims=True)
    weights = jnp.where(row_sum > 0, jnp.exp(row_max - overall_max) * row_sum, 0.0)
    total = weights.sum(axis=2)
    merged = (weights[..., None] * out).sum(axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
    return merged[:, :, :group].reshape(num_seqs, num_heads, head_dim).astype(q.dtype)
