"""Ragged paged attention for TPUs: a Pallas Mosaic kernel.

One batch mixes prompt chunks and decodes, their query rows back to back (`cu_q_lens`). Grid: one program per
query tile, `q_tile` query rows of the whole batch, all heads. Its rows may belong to several sequences (many
decodes, or the end of one chunk and the start of the next); the program takes those sequences one after the
other, and for each walks the pages its rows see, one kv tile of `pages_per_kv_tile` pages per step,
double-buffered (`tpu_page_pipeline`). Each kv tile is fetched once and used by every kv head: the query heads of
one kv head (GQA) and the query tile's rows form the rows of one product, [group * q_tile, head_dim] x [kv_tile,
head_dim]^T. A row of another sequence sees nothing of the kv tile and keeps its online-softmax state (float32,
in VMEM scratch), so each row ends up with exactly its own sequence's attention.

Block tables (flattened), kv lengths, cu_q_lens and each program's first sequence are scalar-prefetch operands
in SMEM. Causal inside each chunk: row i of a sequence with q_len rows and kv_len keys sits at position
kv_len - q_len + i. The pool is in the TPU layout (`tpu_page_pipeline`); its head_dim must be a multiple of 128
(the TPU lane width).

8-bit pages (int8, fp8) come with their per-token scales, fetched beside each page and applied to each kv head's
logits and probabilities (`tpu_page_pipeline`): the products then take q's dtype. Float pages take theirs (q is
cast to it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu_page_pipeline as pipeline
from pallas_kernels.impl import MASK_VALUE, tpu_pool_operands

TPU_Q_TILE = 32  # query rows of one program (times the query heads of a kv head)


def _ragged_kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # [S] int32 (0 for padding rows)
    tables_ref,  # [S * pages_per_seq] int32: block tables, row after row
    cu_q_lens_ref,  # [S + 1] int32 (padding rows: q_len 0)
    first_seq_ref,  # [num_q_tiles] int32: the first sequence with rows in each query tile
    # operands
    q_ref,  # [num_kv_heads, group, q_tile, head_dim] (VMEM): this query tile's rows, in the compute dtype
    pool_hbm,  # (k, v, k_scales, v_scales) (HBM): pages [total_pages, page_size, num_kv_heads * head_dim]; scales
    # [total_pages, rows, 128] for 8-bit pages, None for float pages
    o_ref,  # [num_kv_heads, group, q_tile, head_dim] (VMEM)
    # scratch
    pool_slots,  # their slots [2, pages_per_kv_tile, ...] (VMEM)
    sems,  # [arrays, 2] DMA semaphores
    acc_ref,  # [num_kv_heads, group * q_tile, head_dim] float32
    max_ref,  # [num_kv_heads, group * q_tile, 1] float32
    sum_ref,  # [num_kv_heads, group * q_tile, 1] float32
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_seq: int,
):
    num_kv_heads, group, q_tile, head_dim = q_ref.shape
    k_slots, v_slots, k_scale_slots, v_scale_slots = pool_slots
    pages_per_kv_tile, page_size = k_slots.shape[1:3]
    kv_tile = pages_per_kv_tile * page_size  # keys
    rows = group * q_tile
    num_seqs = kv_lens_ref.shape[0]
    row0 = pl.program_id(0) * q_tile  # first row of this query tile, in the batch
    local = lax.broadcasted_iota(jnp.int32, (q_tile, 1), 0)
    acc_ref[...] = jnp.zeros_like(acc_ref)
    max_ref[...] = jnp.full_like(max_ref, MASK_VALUE)
    sum_ref[...] = jnp.zeros_like(sum_ref)

    def attend_sequence(seq):
        kv_len = kv_lens_ref[seq]
        q_start, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
        # this query tile's rows of the sequence: [lo, hi) in tile coordinates
        lo = jnp.maximum(q_start, row0) - row0
        hi = jnp.minimum(q_end, row0 + q_tile) - row0
        offset = kv_len - q_end + row0  # position of tile row r is offset + r
        first_key = 0 if sliding_window is None else jnp.maximum(offset + lo - sliding_window + 1, 0)
        first_kv_tile = lax.div(first_key, kv_tile)  # non-negative: no floor division (sign) needed
        num_kv_tiles = jnp.where((hi > lo) & (kv_len > 0), lax.div(offset + hi - 1, kv_tile) + 1 - first_kv_tile, 0)
        row_pos = offset + local  # [q_tile, 1]
        in_seq = (local >= lo) & (local < hi)

        def copies(j, slot):
            entry = seq * pages_per_seq + (first_kv_tile + j) * pages_per_kv_tile
            return pipeline.kv_tile_copies(pool_hbm, pool_slots, sems, tables_ref, entry, slot)

        @pl.when(num_kv_tiles > 0)
        def _():
            pipeline.start(copies(0, 0))

        def kv_step(j, carry):
            slot = lax.rem(j, 2)

            @pl.when(j + 1 < num_kv_tiles)
            def _():
                pipeline.start(copies(j + 1, 1 - slot))

            pipeline.wait(copies(j, slot))
            key_pos = (first_kv_tile + j) * kv_tile + lax.broadcasted_iota(jnp.int32, (1, kv_tile), 1)
            visible = in_seq & (key_pos <= row_pos) & (key_pos < kv_len)
            if sliding_window is not None:
                visible &= key_pos > row_pos - sliding_window
            visible = jnp.broadcast_to(visible[None], (group, q_tile, kv_tile)).reshape(rows, kv_tile)
            key_col = key_pos.reshape(kv_tile)
            first_key = (first_kv_tile + j) * kv_tile
            for h in range(num_kv_heads):
                keys = pipeline.head_kv_tile(k_slots, slot, h, head_dim, key_col, kv_len, q_ref.dtype)
                values = pipeline.head_kv_tile(v_slots, slot, h, head_dim, key_col, kv_len, q_ref.dtype)
                scales = tuple(
                    None if x is None else pipeline.head_scales(x, slot, h, first_key, kv_len, page_size)
                    for x in (k_scale_slots, v_scale_slots)
                )
                q = q_ref[h].reshape(rows, head_dim)
                state = (acc_ref[h], max_ref[h], sum_ref[h])
                acc_ref[h], max_ref[h], sum_ref[h] = pipeline.attend(
                    q, keys, values, visible, state, sm_scale=sm_scale, soft_cap=soft_cap, scales=scales
                )
            return carry

        lax.fori_loop(0, num_kv_tiles, kv_step, 0)

    def next_sequence(seq):
        attend_sequence(seq)
        return seq + 1

    def has_rows_here(seq):
        return (seq < num_seqs) & (cu_q_lens_ref[jnp.minimum(seq, num_seqs)] < row0 + q_tile)

    lax.while_loop(has_rows_here, next_sequence, first_seq_ref[pl.program_id(0)])
    for h in range(num_kv_heads):
        out = pipeline.normalized(acc_ref[h], sum_ref[h])
        o_ref[h] = out.reshape(group, q_tile, head_dim).astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "q_tile", "pages_per_kv_tile", "interpret")
)
def tpu_ragged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pages: jax.Array,  # [total_pages, page_size, num_kv_heads * head_dim] (or the public view, see below)
    v_pages: jax.Array,  # like k_pages; head_dim a multiple of 128; float or 8-bit
    kv_lens: jax.Array,  # [S] int32 (0 for padding rows)
    block_tables: jax.Array,  # [S, pages_per_seq] int32; pages_per_seq a multiple of pages_per_kv_tile
    cu_q_lens: jax.Array,  # [S + 1] int32 (padding rows: q_len 0)
    *,
    k_scales: jax.Array | None = None,  # [total_pages, rows, 128] with 8-bit pages (or the public view)
    v_scales: jax.Array | None = None,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    q_tile: int,
    pages_per_kv_tile: int,
    interpret,
) -> jax.Array:  # [T, num_heads, head_dim] in q's dtype; rows of no sequence are 0
    """The kernel call. Arguments are checked by the public `ragged_paged_attention(impl="pallas")`, which passes
    the pool in its own view (pages [total_pages, page_size, num_kv_heads, head_dim]): `impl.tpu_pool_operands`."""
    num_tokens, num_heads, head_dim = q.shape
    pools = tpu_pool_operands((k_pages, v_pages, k_scales, v_scales), head_dim)
    num_kv_heads = pools[0].shape[2] // head_dim
    num_seq_rows, pages_per_seq = block_tables.shape
    group = num_heads // num_kv_heads
    num_q_tiles = pl.cdiv(num_tokens, q_tile)
    padded_tokens = num_q_tiles * q_tile
    # [num_kv_heads, group, tokens, head_dim]: a query tile's rows of one kv head are one [group * q_tile, d] matrix
    q_rows = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded_tokens - num_tokens), (0, 0)))
    q_rows = q_rows.astype(pipeline.compute_dtype(q.dtype, pools[0].dtype))
    q_tile_starts = jnp.arange(num_q_tiles, dtype=jnp.int32) * q_tile
    first_seq = jnp.searchsorted(cu_q_lens[1:], q_tile_starts, side="right").astype(jnp.int32)

    kernel = functools.partial(
        _ragged_kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        pages_per_seq=pages_per_seq,
    )
    rows_spec = pl.BlockSpec((num_kv_heads, group, q_tile, head_dim), lambda t, *_: (0, 0, t, 0))
    state_rows = group * q_tile
    # Every (query tile, sequence) pair a program can take -- at most num_q_tiles + S - 1 -- over all the pages of
    # a block table row: an upper bound (rows of other sequences and keys past kv_len are counted too).
    pairs = num_q_tiles + num_seq_rows - 1
    page_size = pools[0].shape[1]
    cost = pipeline.cost_estimate(q, pools, pairs=pairs, rows=q_tile, keys=pages_per_seq * page_size)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_q_tiles,),
            in_specs=[rows_spec, pipeline.pool_specs(pools)],
            out_specs=rows_spec,
            scratch_shapes=[
                *pipeline.scratch(pools, pages_per_kv_tile),
                pltpu.VMEM((num_kv_heads, state_rows, head_dim), jnp.float32),
                pltpu.VMEM((num_kv_heads, state_rows, 1), jnp.float32),
                pltpu.VMEM((num_kv_heads, state_rows, 1), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=cost,
        interpret=interpret,
        name="jaxpage_tpu_ragged_attention",
    )(kv_lens, block_tables.reshape(-1), cu_q_lens, first_seq, q_rows, pools)
    return out[:, :, :num_tokens].transpose(2, 0, 1, 3).reshape(num_tokens, num_heads, head_dim)
