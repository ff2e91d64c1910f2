"""Ragged paged attention for TPUs: a Pallas Mosaic kernel.

One batch mixes prompt chunks and decodes, their query rows back to back (`cu_q_lens`). Grid: one program per
`q_block` query rows of the whole batch, all heads. Its rows may belong to several sequences (many decodes, or
the end of one chunk and the start of the next); the program takes those sequences one after the other, and for
each walks the pages its rows see, `pages_per_block` pages per step, double-buffered (`tpu_page_pipeline`). Each
block of pages is fetched once and used by every kv head: the query heads of one kv head (GQA) and the block's
rows form the rows of one product, [group * q_block, head_dim] x [block_keys, head_dim]^T. A row of another
sequence sees nothing of the block and keeps its online-softmax state (float32, in VMEM scratch), so each row
ends up with exactly its own sequence's attention.

Block tables (flattened), kv lengths, cu_q_lens and each program's first sequence are scalar-prefetch operands
in SMEM. Causal inside each chunk: row i of a sequence with q_len rows and kv_len keys sits at position
kv_len - q_len + i. The pool's head_dim must be a multiple of 128 (the TPU lane width).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu_page_pipeline as pipeline
from pallas_kernels.impl import MASK_VALUE


def _ragged_kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # [S] int32 (0 for padding rows)
    tables_ref,  # [S * pages_per_seq] int32: block tables, row after row
    cu_q_lens_ref,  # [S + 1] int32 (padding rows: q_len 0)
    first_seq_ref,  # [num_q_blocks] int32: the first sequence with rows in each query block
    # operands
    q_ref,  # [num_kv_heads, group, q_block, head_dim] (VMEM): this block's query rows
    k_hbm,  # [total_pages, page_size, num_kv_heads, head_dim] (HBM)
    v_hbm,
    o_ref,  # [num_kv_heads, group, q_block, head_dim] (VMEM)
    # scratch
    k_slots,  # [2, pages_per_block, page_size, num_kv_heads, head_dim] (VMEM)
    v_slots,
    sems,  # [2, 2] DMA semaphores
    acc_ref,  # [num_kv_heads, group * q_block, head_dim] float32
    max_ref,  # [num_kv_heads, group * q_block, 1] float32
    sum_ref,  # [num_kv_heads, group * q_block, 1] float32
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_seq: int,
):
    num_kv_heads, group, q_block, head_dim = q_ref.shape
    pages_per_block, page_size = k_slots.shape[1:3]
    block_keys = pages_per_block * page_size
    rows = group * q_block
    num_seqs = kv_lens_ref.shape[0]
    row0 = pl.program_id(0) * q_block  # first row of this block, in the batch
    local = lax.broadcasted_iota(jnp.int32, (q_block, 1), 0)
    acc_ref[...] = jnp.zeros_like(acc_ref)
    max_ref[...] = jnp.full_like(max_ref, MASK_VALUE)
    sum_ref[...] = jnp.zeros_like(sum_ref)

    def attend_sequence(seq):
        kv_len = kv_lens_ref[seq]
        q_start, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
        # this block's rows of the sequence: [lo, hi) in block coordinates
        lo = jnp.maximum(q_start, row0) - row0
        hi = jnp.minimum(q_end, row0 + q_block) - row0
        offset = kv_len - q_end + row0  # position of block row r is offset + r
        first_key = 0 if sliding_window is None else jnp.maximum(offset + lo - sliding_window + 1, 0)
        first_block = lax.div(first_key, block_keys)  # non-negative: no floor division (sign) needed
        num_blocks = jnp.where((hi > lo) & (kv_len > 0), lax.div(offset + hi - 1, block_keys) + 1 - first_block, 0)
        row_pos = offset + local  # [q_block, 1]
        in_seq = (local >= lo) & (local < hi)

        def copies(j, slot):
            entry = seq * pages_per_seq + (first_block + j) * pages_per_block
            return pipeline.block_copies(k_hbm, v_hbm, k_slots, v_slots, sems, tables_ref, entry, slot)

        @pl.when(num_blocks > 0)
        def _():
            pipeline.start(copies(0, 0))

        def kv_step(j, carry):
            slot = lax.rem(j, 2)

            @pl.when(j + 1 < num_blocks)
            def _():
                pipeline.start(copies(j + 1, 1 - slot))

            pipeline.wait(copies(j, slot))
            key_pos = (first_block + j) * block_keys + lax.broadcasted_iota(jnp.int32, (1, block_keys), 1)
            visible = in_seq & (key_pos <= row_pos) & (key_pos < kv_len)
            if sliding_window is not None:
                visible &= key_pos > row_pos - sliding_window
            visible = jnp.broadcast_to(visible[None], (group, q_block, block_keys)).reshape(rows, block_keys)
            key_col = key_pos.reshape(block_keys)
            for h in range(num_kv_heads):
                keys = pipeline.head_block(k_slots, slot, h, key_col, kv_len)
                values = pipeline.head_block(v_slots, slot, h, key_col, kv_len)
                q = q_ref[h].reshape(rows, head_dim)
                state = (acc_ref[h], max_ref[h], sum_ref[h])
                acc_ref[h], max_ref[h], sum_ref[h] = pipeline.attend(
                    q, keys, values, visible, state, sm_scale=sm_scale, soft_cap=soft_cap
                )
            return carry

        lax.fori_loop(0, num_blocks, kv_step, 0)

    def next_sequence(seq):
        attend_sequence(seq)
        return seq + 1

    def has_rows_here(seq):
        return (seq < num_seqs) & (cu_q_lens_ref[jnp.minimum(seq, num_seqs)] < row0 + q_block)

    lax.while_loop(has_rows_here, next_sequence, first_seq_ref[pl.program_id(0)])
    for h in range(num_kv_heads):
        out = pipeline.normalized(acc_ref[h], sum_ref[h])
        o_ref[h] = out.reshape(group, q_block, head_dim).astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "q_block", "pages_per_block", "interpret")
)
def tpu_ragged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pages: jax.Array,  # [total_pages, page_size, num_kv_heads, head_dim]; head_dim a multiple of 128
    v_pages: jax.Array,
    kv_lens: jax.Array,  # [S] int32 (0 for padding rows)
    block_tables: jax.Array,  # [S, pages_per_seq] int32; pages_per_seq a multiple of pages_per_block
    cu_q_lens: jax.Array,  # [S + 1] int32 (padding rows: q_len 0)
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    q_block: int,
    pages_per_block: int,
    interpret,
) -> jax.Array:  # [T, num_heads, head_dim] in q's dtype; rows of no sequence are 0
    """The kernel call. Arguments are checked by the public `ragged_paged_attention(impl="pallas")`."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    num_seq_rows, pages_per_seq = block_tables.shape
    group = num_heads // num_kv_heads
    num_q_blocks = pl.cdiv(num_tokens, q_block)
    padded_tokens = num_q_blocks * q_block
    # [num_kv_heads, group, tokens, head_dim]: a block's rows of one kv head are one [group * q_block, d] matrix
    q_rows = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded_tokens - num_tokens), (0, 0)))
    q_rows = q_rows.astype(k_pages.dtype)
    block_starts = jnp.arange(num_q_blocks, dtype=jnp.int32) * q_block
    first_seq = jnp.searchsorted(cu_q_lens[1:], block_starts, side="right").astype(jnp.int32)

    kernel = functools.partial(
        _ragged_kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        pages_per_seq=pages_per_seq,
    )
    rows_spec = pl.BlockSpec((num_kv_heads, group, q_block, head_dim), lambda b, *_: (0, 0, b, 0))
    state_rows = group * q_block
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_q_blocks,),
            in_specs=[rows_spec, pipeline.POOL_SPEC, pipeline.POOL_SPEC],
            out_specs=rows_spec,
            scratch_shapes=[
                *pipeline.scratch(k_pages, pages_per_block),
                pltpu.VMEM((num_kv_heads, state_rows, head_dim), jnp.float32),
                pltpu.VMEM((num_kv_heads, state_rows, 1), jnp.float32),
                pltpu.VMEM((num_kv_heads, state_rows, 1), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="jaxpage_tpu_ragged_attention",
    )(kv_lens, block_tables.reshape(-1), cu_q_lens, first_seq, q_rows, k_pages, v_pages)
    return out[:, :, :num_tokens].transpose(2, 0, 1, 3).reshape(num_tokens, num_heads, head_dim)
