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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridKVCache:
    """The pool of a hybrid model (Gemma 2 and 3: some layers attend through a sliding window, the others to every
    key), as vLLM's hybrid allocator keeps it: a KVCache per group of layers, each with pages of its own and its own
    block tables. `full` stacks the layers that read every key (in layer order), `window` the sliding ones, whose
    sequences keep only their window's pages (jaxpage.engine.kv_cache_groups), so that a long sequence holds its
    whole context in the full layers only."""

    full: KVCache
    window: KVCache


def pool_groups(pool: KVCache | HybridKVCache) -> tuple[KVCache, ...]:
    """The pool's groups of layers, each a KVCache with its own pages: (full, window) for a hybrid, else (pool,)."""
    return (pool.full, pool.window) if isinstance(pool, HybridKVCache) else (pool,)


def group_layer_index(sliding_layers: tuple[bool, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(in the full group, in the window group): each layer's index in its group's KVCache, 0 for a layer of the
    other group (whose write there goes to the null page)."""
    full, window, counts = [], [], [0, 0]
    for sliding in sliding_layers:
        index = counts[sliding]
        counts[sliding] += 1
        full.append(0 if sliding else index)
        window.append(index if sliding else 0)
    return tuple(full), tuple(window)


def copy_pool_pages(pool: KVCache | HybridKVCache, src: jax.Array, dst: jax.Array) -> KVCache | HybridKVCache:
    """copy_pages in each group of the pool: src, dst [groups, C] int32, row g the copies of group g's pages
    (pool_groups' order)."""
    copied = [copy_pages(group, src[g], dst[g]) for g, group in enumerate(pool_groups(pool))]
    return HybridKVCache(*copied) if isinstance(pool, HybridKVCache) else copied[0]
