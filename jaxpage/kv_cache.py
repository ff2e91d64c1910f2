"""The KV page pool: one array for K and one for V, every layer stacked, allocated once per engine.

    k, v: [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    k_scales, v_scales: [num_layers, num_pages, page_size, num_kv_heads]  (8-bit pages only; None otherwise)

Token-major pages: all heads of one token are contiguous, so writing a step's new K/V is one row scatter per
layer, and a page of one layer is a contiguous [page_size, num_kv_heads, head_dim] block that a kernel can fetch
with one DMA. The attention backend (jaxpage.attention) decides head_dim (padded for the TPU kernels) and
reads and writes the pool. Page 0 is the null page: padding tokens write there and padding block-table entries
point there; nothing ever reads it as data (reads stop at each sequence's kv length). 8-bit pages (engine argument
kv_cache_dtype) carry one scale per token per KV head beside them, in the same token-major order
(`pallas_kernels.kv_quantization`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    k_scales: jax.Array | None = None  # [num_layers, num_pages, page_size, num_kv_heads] with 8-bit pages
    v_scales: jax.Array | None = None

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


def copy_pages(kv_cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copies pages src[i] -> dst[i] in every layer (copy-on-write), scales included, as if all at once: every
    source page is read before any destination is written. src, dst: [C] int32; (0, 0) pairs are no-ops.

    One page at a time, by dynamic slices, so that the pool is updated in place: with a gather and a scatter
    (`x.at[:, dst].set(x[:, src])`) the TPU compiler slices the gather's operand in halves, each materialized
    (v5p: 6.9 GiB of temporaries to copy 8 pages of a Llama-3-8B pool)."""

    def copy(x):  # x [num_layers, num_pages, ...]
        pages = jnp.zeros((src.shape[0], x.shape[0], *x.shape[2:]), x.dtype)
        pages = jax.lax.fori_loop(
            0, src.shape[0], lambda i, p: p.at[i].set(jax.lax.dynamic_index_in_dim(x, src[i], 1, False)), pages
        )
        return jax.lax.fori_loop(
            0, src.shape[0], lambda i, x: jax.lax.dynamic_update_index_in_dim(x, pages[i], dst[i], 1), x
        )

    return jax.tree.map(copy, kv_cache)
