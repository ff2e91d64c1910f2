"""The KV page pool and the paged attention the model layers call.

Layout (one array for K, one for V, every layer stacked):

    k, v: [num_layers, num_pages, page_size, num_kv_heads, head_dim]

Token-major pages: all heads of one token are contiguous, so writing a step's new K/V is one row
scatter per layer, and a page of one layer is a contiguous [page_size, num_kv_heads, head_dim] block
that a kernel can fetch with one DMA. Page 0 is the null page: padding tokens write there and padding
block-table entries point there; nothing ever reads it as data (reads stop at each sequence's kv length).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpage.config import ModelConfig
from pallas_kernels.ragged_paged_attention import ragged_paged_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @classmethod
    def allocate(cls, config: ModelConfig, num_pages: int, page_size: int, dtype, sharding=None) -> KVCache:
        shape = (config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim)
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        return cls(k=zeros(), v=zeros())


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """Attention metadata of one ragged step (T tokens of S sequences, padded to the step's bucket)."""

    slot_mapping: jax.Array  # [T] int32, page * page_size + offset where each token's K/V goes (0 for padding)
    block_tables: jax.Array  # [S, P] int32, pages of each sequence (0 past its end)
    kv_lens: jax.Array  # [S] int32, cached tokens of each sequence after this step (0 for padding rows)
    cu_q_lens: jax.Array  # [S + 1] int32, sequence s owns tokens [cu_q_lens[s], cu_q_lens[s + 1])
    num_seqs: jax.Array  # [] int32, real sequences; rows past it are padding


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """Writes the step's K/V into the pool at slot_mapping, then attends through the block tables."""

    sm_scale: float
    sliding_window: int | None = None
    impl: str = "auto"  # EngineConfig.attention_impl

    def __call__(self, q, k, v, batch: PagedBatch, kv_cache: KVCache, layer):
        # q [T, H, d]; k, v [T, K, d]
        page_size = kv_cache.page_size
        pages, offsets = batch.slot_mapping // page_size, batch.slot_mapping % page_size
        kv_cache = KVCache(
            k=kv_cache.k.at[layer, pages, offsets].set(k.astype(kv_cache.k.dtype)),
            v=kv_cache.v.at[layer, pages, offsets].set(v.astype(kv_cache.v.dtype)),
        )
        out = ragged_paged_attention(
            q,
            kv_cache.k,
            kv_cache.v,
            batch.kv_lens,
            batch.block_tables,
            batch.cu_q_lens,
            batch.num_seqs,
            sm_scale=self.sm_scale,
            sliding_window=self.sliding_window,
            layer=layer,
            impl="pallas" if self.impl == "pallas_interpret" else self.impl,
            interpret=self.impl == "pallas_interpret",
        )
        return out, kv_cache


def copy_pages(kv_cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copies pages src[i] -> dst[i] in every layer (copy-on-write). src, dst: [C] int32; (0, 0) pairs are no-ops."""
    return KVCache(k=kv_cache.k.at[:, dst].set(kv_cache.k[:, src]), v=kv_cache.v.at[:, dst].set(kv_cache.v[:, src]))
