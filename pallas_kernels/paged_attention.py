"""Decode paged attention: one query token per sequence, the common serving step. The public entry point.

`impl` ("auto", "xla", "pallas"), `interpret`, `backend` and `platform` pick the implementation as
`pallas_kernels.impl` says: the XLA implementation (`xla_ragged_attention` with `max_q_len=1`: no prefill loop is
compiled) or a Pallas kernel (`tpu_decode_attention`, `gpu_decode_attention`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.impl import kernel_operands, kernel_pool_view, resolve_impl
from pallas_kernels.ragged_paged_attention import check_inputs, check_scales
from pallas_kernels.xla_ragged_attention import platform_tuning, xla_ragged_attention


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
    k_scales: jax.Array | None = None,  # [num_pages, page_size, num_kv_heads] with 8-bit pages ([L, ...] with layer)
    v_scales: jax.Array | None = None,
    impl: str = "auto",
    interpret=False,
    backend: str | None = None,
    platform: str | None = None,
) -> jax.Array:
    """Attention of each sequence's one query token (at position kv_len - 1) to its cached keys.

    Semantics are those of `ragged_paged_attention` with q_len 1 for every sequence: logits `sm_scale * q.k`,
    optionally soft-capped, over the keys at positions 0..kv_len-1 (or the last `sliding_window`); query head h
    reads kv head h // (num_heads // num_kv_heads); float32 softmax; the pool's head_dim may be padded to a
    multiple of 128; 8-bit pages come with their scales. Rows with kv_len 0 give 0; K/V at positions >= kv_len
    are never read into the result, even when they hold NaN.

    Returns [S, num_heads, head_dim] in q's dtype. Raises ValueError for inconsistent shapes or dtypes or an
    unknown impl.
    """
    kernel = resolve_impl(impl, interpret, backend, platform)
    num_seqs = q.shape[0] if q.ndim == 3 else -1
    if q.ndim != 3 or kv_lens.shape != (num_seqs,):
        raise ValueError(f"q must be [S, num_heads, head_dim] and kv_lens [S], got {q.shape} and {kv_lens.shape}")
    cu_q_lens = jnp.arange(num_seqs + 1, dtype=jnp.int32)
    check_inputs(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, jnp.int32(num_seqs), soft_cap, sliding_window, layer
    )
    check_scales(k_pages, v_pages, k_scales, v_scales)
    options = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    head_dim = q.shape[-1]
    q, k_pages, v_pages = kernel_operands(q, k_pages, v_pages, kernel)
    if kernel == "xla":
        metadata = (kv_lens, block_tables, cu_q_lens, jnp.int32(num_seqs), layer, k_scales, v_scales)
        tuning = platform_tuning(platform or jax.default_backend())
        out = xla_ragged_attention(q, k_pages, v_pages, *metadata, **options, **tuning, max_q_len=1)
    elif kernel == "tpu":
        from pallas_kernels.tpu_decode_attention import tpu_decode_attention  # Pallas: imported when used
        from pallas_kernels.tpu_page_pipeline import tpu_pages_per_kv_tile

        pages_per_kv_tile = tpu_pages_per_kv_tile(k_pages.shape[-3])
        pools = (k_pages, v_pages, k_scales, v_scales)
        (k, v, k_scales, v_scales), tables = kernel_pool_view(pools, block_tables, layer, pages_per_kv_tile)
        out = tpu_decode_attention(
            *(q, k, v, kv_lens, tables),
            k_scales=k_scales,
            v_scales=v_scales,
            **options,
            pages_per_kv_tile=pages_per_kv_tile,
            interpret=interpret,
        )
    else:
        from pallas_kernels.gpu_decode_attention import gpu_decode_attention, gpu_decode_tiling

        num_splits, pages_per_kv_tile = gpu_decode_tiling(num_seqs * k_pages.shape[-2], block_tables.shape[-1])
        pools = (k_pages, v_pages, k_scales, v_scales)
        (k, v, k_scales, v_scales), tables = kernel_pool_view(
            pools, block_tables, layer, num_splits * pages_per_kv_tile
        )
        out = gpu_decode_attention(
            *(q, k, v, kv_lens, tables),
            k_scales=k_scales,
            v_scales=v_scales,
            **options,
            num_splits=num_splits,
            pages_per_kv_tile=pages_per_kv_tile,
            interpret=interpret,
        )
    return out[..., :head_dim]
