"""Decode paged attention: one query token per sequence, the common serving step. The public entry point.

`impl` ("auto", "reference", "pallas"), `interpret` and `backend` pick the implementation as `pallas_kernels.impl`
says; the Pallas kernels are `tpu_decode_attention` and `gpu_decode_attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gpu_decode_attention import gpu_decode_attention
from pallas_kernels.impl import kernel_operands, kernel_pool_view, resolve_impl
from pallas_kernels.ragged_paged_attention import check_inputs, ragged_paged_attention, tpu_pages_per_block
from pallas_kernels.tpu_decode_attention import tpu_decode_attention

PAGES_PER_BLOCK = 8  # pages a kernel program reads per step (128 keys at page size 16)
MAX_SPLITS = 8
TARGET_PROGRAMS = 256  # split sequences until sequences x kv heads x splits reaches about this many programs


def paged_attention(
    q: jax.Array,  # [S, num_heads, head_dim]  one query token per sequence
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim], or with `layer` [L, num_pages, ...]
    v_pages: jax.Array,  # same shape as k_pages
    kv_lens: jax.Array,  # [S] int32  tokens in the cache (the query's own included); 0 for padding rows
    block_tables: jax.Array,  # [S, pages_per_seq] int32  page ids; entries past a sequence's end are ignored
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | None = None,  # [] int32: read this layer of a stacked pool in place
    impl: str = "auto",
    interpret=False,
    backend: str | None = None,
) -> jax.Array:
    """Attention of each sequence's one query token (at position kv_len - 1) to its cached keys.

    Semantics are those of `ragged_paged_attention` with q_len 1 for every sequence: logits `sm_scale * q.k`,
    optionally soft-capped, over the keys at positions 0..kv_len-1 (or the last `sliding_window`); query head h
    reads kv head h // (num_heads // num_kv_heads); float32 softmax; the pool's head_dim may be padded to a
    multiple of 128. Rows with kv_len 0 give 0; K/V at positions >= kv_len are never read into the result, even
    when they hold NaN.

    Returns [S, num_heads, head_dim] in q's dtype. Raises ValueError for inconsistent shapes or dtypes or an
    unknown impl.
    """
    kernel = resolve_impl(impl, interpret, backend)
    num_seqs = q.shape[0] if q.ndim == 3 else -1
    if q.ndim != 3 or kv_lens.shape != (num_seqs,):
        raise ValueError(f"q must be [S, num_heads, head_dim] and kv_lens [S], got {q.shape} and {kv_lens.shape}")
    cu_q_lens = jnp.arange(num_seqs + 1, dtype=jnp.int32)
    options = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    if kernel == "reference":
        metadata = (kv_lens, block_tables, cu_q_lens, jnp.int32(num_seqs))
        return ragged_paged_attention(q, k_pages, v_pages, *metadata, **options, layer=layer)
    check_inputs(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, jnp.int32(num_seqs), soft_cap, sliding_window, layer
    )
    head_dim = q.shape[-1]
    q, k_pages, v_pages = kernel_operands(q, k_pages, v_pages, kernel)
    pages_per_seq = block_tables.shape[-1]
    if kernel == "tpu":
        pages_per_block = tpu_pages_per_block(k_pages.shape[-3])
        k, v, tables = kernel_pool_view(k_pages, v_pages, block_tables, layer, pages_per_block)
        out = tpu_decode_attention(
            q, k, v, kv_lens, tables, **options, pages_per_block=pages_per_block, interpret=interpret
        )
        return out[..., :head_dim]
    pages_per_block = min(PAGES_PER_BLOCK, pl.next_power_of_2(pages_per_seq))
    num_splits = _num_splits(num_seqs * k_pages.shape[-2], -(-pages_per_seq // pages_per_block))
    k, v, tables = kernel_pool_view(k_pages, v_pages, block_tables, layer, num_splits * pages_per_block)
    out = gpu_decode_attention(
        *(q, k, v, kv_lens, tables),
        **options,
        num_splits=num_splits,
        pages_per_block=pages_per_block,
        interpret=interpret,
    )
    return out[..., :head_dim]


def _num_splits(programs: int, blocks: int) -> int:
    """Splits of each block table: a power of two, at most the blocks there are and MAX_SPLITS."""
    splits = 1
    while splits * 2 <= min(blocks, MAX_SPLITS) and programs * splits < TARGET_PROGRAMS:
        splits *= 2
    return splits
