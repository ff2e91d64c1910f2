"""Decode paged attention for TPUs: a Pallas Mosaic kernel.

One query token per sequence attends to that sequence's keys in the paged KV pool. Grid: one program per
sequence, all heads. It walks the sequence's pages one kv tile of `pages_per_kv_tile` pages at a time,
double-buffered (`tpu_page_pipeline`); each kv tile is fetched once and used by every kv head, whose query heads
(GQA) form the rows of its products. Softmax statistics and accumulator are float32.

Decode sequences are often short (a kv tile or two), so a program would wait on its first fetch every time. The
pipeline therefore runs across programs: while a program computes its last kv tile, it already fetches the next
sequence's first kv tile into the other slot, and records in SMEM scratch which sequence that tile belongs to and
which slot is current. This needs the grid to run in order ("arbitrary" dimension semantics).

Block tables (flattened) and kv lengths are scalar-prefetch operands in SMEM. The pool is in the TPU layout
(`tpu_page_pipeline`); its head_dim must be a multiple of 128 (the TPU lane width).

8-bit pages (int8, fp8) come with their per-token scales, fetched beside each page (the next sequence's first kv
tile's too) and applied to each kv head's logits and probabilities (`tpu_page_pipeline`): the products then take
q's dtype. Float pages take theirs (q is cast to it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu_page_pipeline as pipeline
from pallas_kernels.impl import tpu_pool_operands

_SLOT, _PREFETCHED = 0, 1  # entries of the SMEM pipeline state


def _decode_kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # [S] int32 (0 for padding rows)
    tables_ref,  # [S * pages_per_seq] int32: block tables, row after row
    # operands
    q_ref,  # [num_heads, head_dim] (VMEM): this sequence's query
    pool_hbm,  # (k, v, k_scales, v_scales) (HBM): pages [total_pages, page_size, num_kv_heads * head_dim]; scales
    # [total_pages, rows, 128] for 8-bit pages, None for float pages
    o_ref,  # [num_heads, head_dim] (VMEM)
    # scratch
    pool_slots,  # their slots [2, pages_per_kv_tile, ...] (VMEM)
    sems,  # [arrays, 2] DMA semaphores
    pipeline_ref,  # [2] int32 (SMEM): the slot the next kv tile lands in; the sequence whose first is in flight
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_seq: int,
):
    num_heads, head_dim = q_ref.shape
    k_slots, v_slots, k_scale_slots, v_scale_slots = pool_slots
    pages_per_kv_tile, page_size = k_slots.shape[1:3]
    num_kv_heads = k_slots.shape[3] // head_dim
    group = num_heads // num_kv_heads
    kv_tile = pages_per_kv_tile * page_size  # keys
    num_seqs = kv_lens_ref.shape[0]
    seq = pl.program_id(0)

    @pl.when(seq == 0)
    def _():
        pipeline_ref[_SLOT] = 0
        pipeline_ref[_PREFETCHED] = -1

    def kv_tiles(s):
        """(first kv tile, number of kv tiles) of sequence s's keys: those its query (at kv_len - 1) sees."""
        kv_len = kv_lens_ref[s]
        first_key = 0 if sliding_window is None else jnp.maximum(kv_len - sliding_window, 0)
        first_kv_tile = lax.div(first_key, kv_tile)  # non-negative: no floor division (sign) needed
        return first_kv_tile, jnp.where(kv_len > 0, lax.div(kv_len - 1, kv_tile) + 1 - first_kv_tile, 0)

    def copies(s, tile, slot):
        entry = s * pages_per_seq + tile * pages_per_kv_tile
        return pipeline.kv_tile_copies(pool_hbm, pool_slots, sems, tables_ref, entry, slot)

    kv_len = kv_lens_ref[seq]
    first_kv_tile, num_kv_tiles = kv_tiles(seq)

    @pl.when((num_kv_tiles > 0) & (pipeline_ref[_PREFETCHED] != seq))
    def _():
        pipeline.start(copies(seq, first_kv_tile, pipeline_ref[_SLOT]))

    next_seq = jnp.minimum(seq + 1, num_seqs - 1)
    next_first_kv_tile, next_num_kv_tiles = kv_tiles(next_seq)
    q = q_ref[...].astype(pipeline.compute_dtype(q_ref.dtype, k_slots.dtype))

    def kv_step(j, state):
        slot = pipeline_ref[_SLOT]

        @pl.when(j + 1 < num_kv_tiles)
        def _():
            pipeline.start(copies(seq, first_kv_tile + j + 1, 1 - slot))

        @pl.when((j + 1 == num_kv_tiles) & (seq + 1 < num_seqs) & (next_num_kv_tiles > 0))
        def _():
            pipeline.start(copies(next_seq, next_first_kv_tile, 1 - slot))
            pipeline_ref[_PREFETCHED] = next_seq

        pipeline.wait(copies(seq, first_kv_tile + j, slot))
        pipeline_ref[_SLOT] = 1 - slot
        key_pos = (first_kv_tile + j) * kv_tile + lax.broadcasted_iota(jnp.int32, (1, kv_tile), 1)
        visible = key_pos < kv_len
        if sliding_window is not None:
            visible &= key_pos >= kv_len - sliding_window
        visible = jnp.broadcast_to(visible, (group, kv_tile))
        key_col = key_pos.reshape(kv_tile)
        first_key = (first_kv_tile + j) * kv_tile
        new_state = []
        for h in range(num_kv_heads):
            keys = pipeline.head_kv_tile(k_slots, slot, h, head_dim, key_col, kv_len, q.dtype)
            values = pipeline.head_kv_tile(v_slots, slot, h, head_dim, key_col, kv_len, q.dtype)
            scales = tuple(
                None if x is None else pipeline.head_scales(x, slot, h, first_key, kv_len, page_size)
                for x in (k_scale_slots, v_scale_slots)
            )
            q_heads = q[h * group : (h + 1) * group]
            new_state.append(
                pipeline.attend(
                    q_heads, keys, values, visible, state[h], sm_scale=sm_scale, soft_cap=soft_cap, scales=scales
                )
            )
        return tuple(new_state)

    init = tuple(pipeline.initial_state(group, head_dim) for _ in range(num_kv_heads))
    state = lax.fori_loop(0, num_kv_tiles, kv_step, init)
    out = jnp.concatenate([pipeline.normalized(acc, row_sum) for acc, _, row_sum in state], axis=0)
    o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "pages_per_kv_tile", "interpret")
)
def tpu_decode_attention(
    q: jax.Array,  # [S, num_heads, head_dim]
    k_pages: jax.Array,  # [total_pages, page_size, num_kv_heads * head_dim] (or the public view, see below)
    v_pages: jax.Array,  # like k_pages; head_dim a multiple of 128; float or 8-bit
    kv_lens: jax.Array,  # [S] int32 (0 for padding rows)
    block_tables: jax.Array,  # [S, pages_per_seq] int32; pages_per_seq a multiple of pages_per_kv_tile
    *,
    k_scales: jax.Array | None = None,  # [total_pages, rows, 128] with 8-bit pages (or the public view)
    v_scales: jax.Array | None = None,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_kv_tile: int,
    interpret,
) -> jax.Array:  # [S, num_heads, head_dim] in q's dtype; rows with kv_len 0 are 0
    """The kernel call. Arguments are checked by the public `paged_attention(impl="pallas")`, which passes the pool
    in its own view (pages [total_pages, page_size, num_kv_heads, head_dim]): `impl.tpu_pool_operands`."""
    num_seqs, num_heads, head_dim = q.shape
    pools = tpu_pool_operands((k_pages, v_pages, k_scales, v_scales), head_dim)
    pages_per_seq = block_tables.shape[1]
    kernel = functools.partial(
        _decode_kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        pages_per_seq=pages_per_seq,
    )
    rows_spec = pl.BlockSpec((None, num_heads, head_dim), lambda s, *_: (s, 0, 0))
    # Every sequence over all the pages of its block table row: an upper bound (keys past kv_len are counted too).
    keys = pages_per_seq * pools[0].shape[1]
    cost = pipeline.cost_estimate(q, pools, pairs=num_seqs, rows=1, keys=keys)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_seqs,),
            in_specs=[rows_spec, pipeline.pool_specs(pools)],
            out_specs=rows_spec,
            scratch_shapes=[*pipeline.scratch(pools, pages_per_kv_tile), pltpu.SMEM((2,), jnp.int32)],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        cost_estimate=cost,
        interpret=interpret,
        name="jaxpage_tpu_decode_attention",
    )(kv_lens, block_tables.reshape(-1), q, pools)
    return out
