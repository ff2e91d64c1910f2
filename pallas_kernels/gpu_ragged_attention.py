"""Ragged paged attention for NVIDIA GPUs: a Pallas kernel (Triton lowering; see `gpu_decode_attention` for why).

One batch mixes prompt chunks and decodes, their query rows back to back (`cu_q_lens`). The rows of one kv head's
products are (token, query head) pairs: for each kv head the queries are laid out [T * group, head_dim], a token's
`group` query heads (GQA) next to each other, so a program's rows are any `q_rows` consecutive pairs and no row is
padding the group does not need (a 128-row program holds 42 2/3 tokens of a group of 3 as well as 32 of 4).
Grid (sequence, row tile, kv head): a program takes up to `q_rows` rows of one sequence and one kv head and walks
that sequence's pages one kv tile of `pages_per_kv_tile` pages at a time (fewer where such tiles would be larger
than `gpu_online_softmax.MAX_KV_TILE_BYTES`), up to the last key its rows see, gathering them through the block
table (an ordinary operand: the Triton lowering has no scalar prefetch) with an online softmax in float32 and the
products on the tensor cores (`gpu_online_softmax`). Programs past a sequence's rows do nothing. Rows are stored
under a mask, so a program never writes a neighbour's rows; the query and output arrays carry `q_rows` rows of
padding so that every program's rows exist.

Causal inside each chunk: the token of row r of a sequence with q_len tokens and kv_len keys sits at position
kv_len - q_len + r // group. 8-bit pages (int8, fp8; `pallas_kernels.kv_quantization`) come with per-token scales,
one more pair of operands blocked by kv head like the pages (float pools compile without them). K/V at positions
>= kv_len never reach the result, even when they hold NaN (`gpu_online_softmax.attend_pages`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu_online_softmax import (
    attend_pages,
    check_pool_offsets,
    cost_estimate,
    initial_state,
    kv_step_pages,
    load_query,
    normalized,
)

# (token, query head) rows of one program, the rows of its products: 128 for tensor-core products; 16 for a float32
# model's scalar ones (each thread holds whole rows of their operands: 32 rows took 254 registers, 128 spilled 12 KB)
GPU_Q_ROWS = 128
GPU_F32_Q_ROWS = 16
GPU_PAGES_PER_KV_TILE = 8  # pages it reads per step, at most
# A program's warps: 4 (one warpgroup: Hopper's wgmma products), or 8 where the float32 accumulator [q_rows, head_dim]
# and logits [q_rows, kv_tile] would take more than MAX_FLOAT32_REGISTERS of each of 4 warps' threads (at 4 warps a
# 128 x 64 accumulator with 128 x 128 logits spilled 216 bytes, 64 x 256 with 64 x 32 spilled 64; 8 warps: none).
MAX_FLOAT32_REGISTERS = 160


def ragged_warps(q_rows: int, head_dim: int, kv_tile: int) -> int:
    """Warps of a program with q_rows rows, head_dim and kv_tile keys a step."""
    return 4 if q_rows * (head_dim + kv_tile) <= 4 * 32 * MAX_FLOAT32_REGISTERS else 8


def _ragged_kernel(
    kv_lens_ref,  # [S] int32
    cu_q_lens_ref,  # [S + 1] int32
    tables_ref,  # [pages_per_seq] int32: this sequence's block table (page ids into the flattened pool)
    q_ref,  # [T * group + q_rows, head_dim]: this kv head's (token, query head) rows
    k_ref,  # [total_pages, page_size, head_dim]: this kv head's K pool
    v_ref,  # [total_pages, page_size, head_dim]
    scale_refs,  # 8-bit pages: (k_scale_ref, v_scale_ref) [total_pages, page_size], this kv head's; else ()
    zeros_ref,  # the output's initial value (aliased to o_ref): rows no program writes stay 0
    o_ref,  # [T * group + q_rows, head_dim]: output rows, this kv head's
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    group: int,
    q_rows: int,
    pages_per_kv_tile: int,
):
    seq = pl.program_id(0)
    page_size, head_dim = k_ref.shape[1:]
    kv_tile = pages_per_kv_tile * page_size  # keys
    kv_len = kv_lens_ref[seq]
    q_start, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
    q_len = q_end - q_start
    num_rows = q_len * group  # this sequence's rows
    first_row = pl.program_id(1) * q_rows  # of this sequence's rows

    @pl.when((first_row < num_rows) & (kv_len > 0))
    def _():
        local = first_row + jnp.arange(q_rows)
        in_seq = local < num_rows  # [q_rows]
        row_pos = kv_len - q_len + local // group  # [q_rows]: the position of each row's token
        q = load_query(q_ref, pl.ds(q_start * group + first_row, q_rows))
        # Keys these rows see: up to their last token's position, from their first token's window.
        last_key = kv_len - q_len + (jnp.minimum(first_row + q_rows, num_rows) - 1) // group
        first_key = 0
        if sliding_window is not None:
            first_key = jnp.maximum(kv_len - q_len + first_row // group - sliding_window + 1, 0)
        first_kv_tile = first_key // kv_tile
        num_kv_tiles = last_key // kv_tile + 1 - first_kv_tile

        def kv_tile_step(j, state):
            start_page = (first_kv_tile + j) * pages_per_kv_tile
            page_ids = tables_ref[pl.ds(start_page, pages_per_kv_tile)]
            key_pos = start_page * page_size + jnp.arange(kv_tile)
            visible = (key_pos[None, :] <= row_pos[:, None]) & (key_pos[None, :] < kv_len)
            if sliding_window is not None:
                visible &= key_pos[None, :] > row_pos[:, None] - sliding_window
            kwargs = dict(sm_scale=sm_scale, soft_cap=soft_cap)
            return attend_pages(q, k_ref, v_ref, scale_refs, page_ids, key_pos, kv_len, visible, state, **kwargs)

        state = lax.fori_loop(0, num_kv_tiles, kv_tile_step, initial_state(q_rows, head_dim))
        out = normalized(state)
        plgpu.store(
            o_ref.at[pl.ds(q_start * group + first_row, q_rows)],
            out.astype(o_ref.dtype),
            mask=jnp.broadcast_to(in_seq[:, None], out.shape),
        )


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "q_rows", "pages_per_kv_tile", "interpret")
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
    q_rows: int | None = None,
    pages_per_kv_tile: int = GPU_PAGES_PER_KV_TILE,
    interpret: bool,
) -> jax.Array:  # [T, num_heads, head_dim] in q's dtype; rows of no sequence are 0
    """The kernel call. Arguments are checked by the public `ragged_paged_attention(impl="pallas")`.

    q_rows: a power of two, at least 16 (the tensor cores' smallest product); None: GPU_Q_ROWS, or GPU_F32_Q_ROWS for
    a float32 q. A program reads pages_per_kv_tile pages per step, fewer where their tile would be too large
    (`kv_step_pages`)."""
    check_pool_offsets(k_pages)
    if q_rows is None:
        q_rows = GPU_F32_Q_ROWS if q.dtype == jnp.float32 else GPU_Q_ROWS
    num_tokens, num_heads, head_dim = q.shape
    total_pages, page_size, num_kv_heads, _ = k_pages.shape
    num_seq_rows, pages_per_seq = block_tables.shape
    group = num_heads // num_kv_heads
    num_rows = num_tokens * group
    # [num_kv_heads, T * group + q_rows, head_dim]: a kv head's (token, query head) rows, token-major
    q_rows_of_heads = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    q_rows_of_heads = jnp.pad(q_rows_of_heads.reshape(num_kv_heads, num_rows, head_dim), ((0, 0), (0, q_rows), (0, 0)))

    step_pages = kv_step_pages(pages_per_kv_tile, page_size, head_dim, q.dtype.itemsize)
    kernel = functools.partial(
        _ragged_kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        group=group,
        q_rows=q_rows,
        pages_per_kv_tile=step_pages,
    )
    rows_spec = pl.BlockSpec((None, num_rows + q_rows, head_dim), lambda s, t, k: (k, 0, 0))
    pool_spec = pl.BlockSpec((total_pages, page_size, None, head_dim), lambda s, t, k: (0, 0, k, 0))
    scales = () if k_scales is None else (k_scales, v_scales)
    scale_spec = pl.BlockSpec((total_pages, page_size, None), lambda s, t, k: (0, 0, k))
    # An upper bound: the row tiles that hold rows (at most one per q_rows rows, plus one more per sequence where its
    # rows start mid-tile), each against every key of its (padded) block table, per kv head.
    row_tiles = pl.cdiv(num_rows, q_rows)
    keys = min(num_seq_rows * row_tiles, row_tiles + num_seq_rows) * num_kv_heads * pages_per_seq * page_size
    cost = cost_estimate(
        pairs=keys * q_rows,
        keys_read=keys,
        head_dim=head_dim,
        kv_itemsize=k_pages.dtype.itemsize,
        scale_itemsize=0 if k_scales is None else k_scales.dtype.itemsize,
        soft_cap=soft_cap,
        other_bytes=3 * q_rows_of_heads.nbytes + block_tables.nbytes + kv_lens.nbytes + cu_q_lens.nbytes,
    )
    out = pl.pallas_call(
        kernel,
        grid=(num_seq_rows, row_tiles, num_kv_heads),
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
        out_shape=jax.ShapeDtypeStruct(q_rows_of_heads.shape, q.dtype),
        input_output_aliases={6 + len(scales): 0},  # the zeros
        # Triton, explicitly: without compiler_params jax lowers to Mosaic GPU (jax_pallas_use_mosaic_gpu's default).
        compiler_params=plgpu.CompilerParams(num_warps=ragged_warps(q_rows, head_dim, step_pages * page_size)),
        cost_estimate=cost,
        interpret=interpret,
        name="jaxpage_gpu_ragged_attention",
    )(kv_lens, cu_q_lens, block_tables, q_rows_of_heads, k_pages, v_pages, scales, jnp.zeros_like(q_rows_of_heads))
    out = out[:, :num_rows].reshape(num_kv_heads, num_tokens, group, head_dim).transpose(1, 0, 2, 3)
    return out.reshape(num_tokens, num_heads, head_dim)
