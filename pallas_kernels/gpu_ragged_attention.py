"""Ragged paged attention for NVIDIA GPUs: a Pallas kernel (Triton lowering; see `gpu_decode_attention` for why).

One batch mixes prompt chunks and decodes, their query rows back to back (`cu_q_lens`). Grid (sequence, query
tile, kv head): a program takes a query tile -- up to `q_tile` query rows of one sequence -- and the query heads of
one kv head (GQA: rows x heads form the rows of its products, padded to a power of two), and walks that sequence's
pages one kv tile of `pages_per_kv_tile` pages at a time (fewer where such tiles would not fit in shared memory), up
to the last key its rows see, gathering them through the block table (an ordinary operand: the Triton lowering has
no scalar prefetch) with an online softmax in float32. Programs past a sequence's rows do nothing. Rows are stored
under a mask, so a query tile never writes a neighbour's rows; the query and output arrays carry `q_tile` rows of
padding so that every tile's rows exist.

Causal inside each chunk: row i of a sequence with q_len rows and kv_len keys sits at position kv_len - q_len + i.
8-bit pages (int8, fp8; `pallas_kernels.kv_quantization`) come with per-token scales, one more pair of operands
blocked by kv head like the pages: each kv tile is read in 8 bits and multiplied by its scales in the kernel (float
pools compile without them). K/V at positions >= kv_len are zeroed before use (not only masked): stale slots may
hold NaN, in 8-bit pages also their scales.
"""

from __future__ import annotations

import functools

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
    normalized,
)

GPU_Q_TILE = 16  # query rows of one program
GPU_PAGES_PER_KV_TILE = 8  # pages it reads per step


def _ragged_kernel(
    kv_lens_ref,  # [S] int32
    cu_q_lens_ref,  # [S + 1] int32
    tables_ref,  # [pages_per_seq] int32: this sequence's block table (page ids into the flattened pool)
    q_ref,  # [T + q_tile, group, head_dim]: every query row, this kv head's query heads (padded)
    k_ref,  # [total_pages, page_size, head_dim]: this kv head's K pool
    v_ref,  # [total_pages, page_size, head_dim]
    scale_refs,  # 8-bit pages: (k_scale_ref, v_scale_ref) [total_pages, page_size], this kv head's; else ()
    zeros_ref,  # the output's initial value (aliased to o_ref): rows no program writes stay 0
    o_ref,  # [T + q_tile, group, head_dim]: output rows, this kv head's heads
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    q_tile: int,
    pages_per_kv_tile: int,
):
    seq = pl.program_id(0)
    page_size, head_dim = k_ref.shape[1:]
    group = q_ref.shape[1]
    kv_tile = pages_per_kv_tile * page_size  # keys
    kv_len = kv_lens_ref[seq]
    q_start, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
    q_len = q_end - q_start
    first_row = pl.program_id(1) * q_tile  # of this sequence

    @pl.when((first_row < q_len) & (kv_len > 0))
    def _():
        local = first_row + jnp.arange(q_tile)
        in_seq = local < q_len  # [q_tile]
        query_pos = kv_len - q_len + local  # [q_tile]
        rows = q_ref.at[pl.ds(q_start + first_row, q_tile)]
        q = plgpu.load(rows).astype(jnp.float32).reshape(q_tile * group, head_dim)
        # Keys this query tile sees: up to its last row's position (or kv_len - 1), from its first row's window.
        last_key = jnp.minimum(kv_len - q_len + jnp.minimum(first_row + q_tile, q_len) - 1, kv_len - 1)
        first_key = 0 if sliding_window is None else jnp.maximum(kv_len - q_len + first_row - sliding_window + 1, 0)
        first_kv_tile = first_key // kv_tile
        num_kv_tiles = last_key // kv_tile + 1 - first_kv_tile
        # [q_tile * group]: the heads of a query row share its position
        row_pos = jnp.broadcast_to(query_pos[:, None], (q_tile, group)).reshape(-1)

        def kv_tile_step(j, state):
            start_page = (first_kv_tile + j) * pages_per_kv_tile
            page_ids = tables_ref[pl.ds(start_page, pages_per_kv_tile)]
            key_pos = start_page * page_size + jnp.arange(kv_tile)
            visible = (key_pos[None, :] <= row_pos[:, None]) & (key_pos[None, :] < kv_len)
            if sliding_window is not None:
                visible &= key_pos[None, :] > row_pos[:, None] - sliding_window
            kwargs = dict(sm_scale=sm_scale, soft_cap=soft_cap)
            return attend_pages(q, k_ref, v_ref, scale_refs, page_ids, key_pos, kv_len, visible, state, **kwargs)

        state = lax.fori_loop(0, num_kv_tiles, kv_tile_step, initial_state(q_tile * group, head_dim))
        out = normalized(state).reshape(q_tile, group, head_dim)
        plgpu.store(
            o_ref.at[pl.ds(q_start + first_row, q_tile)],
            out.astype(o_ref.dtype),
            mask=jnp.broadcast_to(in_seq[:, None, None], out.shape),
        )


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "q_tile", "pages_per_kv_tile", "interpret")
)
def gpu_ragged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pages: jax.Array,  # [total_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [total_pages, page_size, num_kv_heads, head_dim]
    kv_lens: jax.Array,  # [S] int32 (0 for padding rows)
    block_tables: jax.Array,  # [S, pages_per_seq] int32; pages_per_seq a multiple of pages_per_kv_tile
    cu_q_lens: jax.Array,  # [S + 1] int32 (padding rows: q_len 0)
    *,
    k_scales: jax.Array | None = None,  # [total_pages, page_size, num_kv_heads] with 8-bit pages
    v_scales: jax.Array | None = None,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    q_tile: int,
    pages_per_kv_tile: int,
    interpret: bool,
) -> jax.Array:  # [T, num_heads, head_dim] in q's dtype; rows of no sequence are 0
    """The kernel call. Arguments are checked by the public `ragged_paged_attention(impl="pallas")`.

    A program reads pages_per_kv_tile pages per step, fewer where their tile would not fit in shared memory
    (`kv_step_pages`)."""
    check_pool_offsets(k_pages)
    num_tokens, num_heads, head_dim = q.shape
    total_pages, page_size, num_kv_heads, _ = k_pages.shape
    num_seq_rows, pages_per_seq = block_tables.shape
    group = num_heads // num_kv_heads
    padded_group = max(pl.next_power_of_2(group), -(-MIN_DOT_ROWS // q_tile))
    q_rows = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q_rows = jnp.pad(q_rows, ((0, q_tile), (0, 0), (0, padded_group - group), (0, 0)))

    kernel = functools.partial(
        _ragged_kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        q_tile=q_tile,
        pages_per_kv_tile=kv_step_pages(pages_per_kv_tile, page_size, head_dim, k_pages.dtype.itemsize),
    )
    rows_spec = pl.BlockSpec((num_tokens + q_tile, None, padded_group, head_dim), lambda s, t, k: (0, k, 0, 0))
    pool_spec = pl.BlockSpec((total_pages, page_size, None, head_dim), lambda s, t, k: (0, 0, k, 0))
    scales = () if k_scales is None else (k_scales, v_scales)
    scale_spec = pl.BlockSpec((total_pages, page_size, None), lambda s, t, k: (0, 0, k))
    # An upper bound: the query tiles that hold rows (at most one per q_tile rows, plus one more per sequence where
    # its rows start mid-tile), each against every key of its (padded) block table, per kv head.
    q_tiles = pl.cdiv(num_tokens, q_tile)
    keys = min(num_seq_rows * q_tiles, q_tiles + num_seq_rows) * num_kv_heads * pages_per_seq * page_size
    cost = cost_estimate(
        pairs=keys * q_tile * padded_group,
        keys_read=keys,
        head_dim=head_dim,
        kv_itemsize=k_pages.dtype.itemsize,
        scale_itemsize=0 if k_scales is None else k_scales.dtype.itemsize,
        soft_cap=soft_cap,
        other_bytes=3 * q_rows.nbytes + block_tables.nbytes + kv_lens.nbytes + cu_q_lens.nbytes,  # q, zeros, out
    )
    out = pl.pallas_call(
        kernel,
        grid=(num_seq_rows, pl.cdiv(num_tokens, q_tile), num_kv_heads),
        in_specs=[
            pl.BlockSpec((num_seq_rows,), lambda s, t, k: (0,)),
            pl.BlockSpec((num_seq_rows + 1,), lambda s, t, k: (0,)),
            pl.BlockSpec((None, pages_per_seq), lambda s, t, k: (s, 0)),
            rows_spec,
            pool_spec,
            pool_spec,
            tuple(scale_spec for _ in scales),
            rows_spec,
        ],
        out_specs=rows_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        input_output_aliases={6 + len(scales): 0},  # the zeros
        # Triton, explicitly: without compiler_params jax lowers to Mosaic GPU (jax_pallas_use_mosaic_gpu's default).
        compiler_params=plgpu.CompilerParams(),
        cost_estimate=cost,
        interpret=interpret,
        name="jaxpage_gpu_ragged_attention",
    )(kv_lens, cu_q_lens, block_tables, q_rows, k_pages, v_pages, scales, jnp.zeros_like(q_rows))
    return out[:num_tokens, :, :group].reshape(num_tokens, num_heads, head_dim)
