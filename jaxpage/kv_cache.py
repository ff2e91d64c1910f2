"""The KV page pool: one array for K and one for V, every layer stacked, allocated once per engine.

    k, v: [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    k_scales, v_scales: [num_layers, num_pages, page_size, num_kv_heads]  (8-bit pages only; None otherwise)

Token-major pages: all heads of one token are contiguous, so writing a step's new K/V is one row scatter per
layer, and a page of one layer is a contiguous [page_size, num_kv_heads, head_dim] block that a kernel can fetch
with one DMA. The attention backend (jaxpage.attention_backend) decides head_dim (padded for the TPU kernels) and
reads and writes the pool. Page 0 is the null page: padding tokens write there and padding block-table entries
point there; nothing ever reads it as data (reads stop at each sequence's kv length). 8-bit pages (engine argument
kv_cache_dtype) carry one scale per token per KV head beside them, in the same token-major order
(`pallas_kernels.kv_quantization`).
"""

from __future__ import annotations

import dataclasses

import jax


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
    """Copies pages src[i] -> dst[i] in every layer (copy-on-write), scales included. src, dst: [C] int32; (0, 0)
    pairs are no-ops."""
    return jax.tree.map(lambda x: x.at[:, dst].set(x[:, src]), kv_cache)
