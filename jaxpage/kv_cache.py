"""The KV page pool and the paged attention the model layers call.

Layout (one array for K, one for V, every layer stacked):

    k, v: [num_layers, num_pages, page_size, num_kv_heads, head_dim]

Token-major pages: all heads of one token are contiguous, so writing a step's new K/V is one row
scatter per layer, and a page of one layer is a contiguous [page_size, num_kv_heads, head_dim] block
that a kernel can fetch with one DMA. For the TPU kernels head_dim is padded with zeros to a multiple of 128 (the
lane width). Page 0 is the null page: padding tokens write there and padding
block-table entries point there; nothing ever reads it as data (reads stop at each sequence's kv length).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxpage.config import ModelConfig
from pallas_kernels.impl import pad_head_dim, padded_head_dim, resolve_impl
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

# EngineConfig.attention_impl -> the attention functions' impl, interpret and backend arguments
ATTENTION_ARGS = {
    "auto": dict(impl="auto"),
    "reference": dict(impl="reference"),
    "pallas": dict(impl="pallas"),
    "pallas_tpu_interpret": dict(impl="pallas", interpret=True, backend="tpu"),
    "pallas_gpu_interpret": dict(impl="pallas", interpret=True, backend="gpu"),
}


def pool_head_dim(head_dim: int, attention_impl: str) -> int:
    """The pool's head_dim: padded to a multiple of 128 where the TPU kernels read it; raises ValueError where the
    attention cannot run on this backend."""
    try:
        kernel = resolve_impl(**ATTENTION_ARGS[attention_impl])
    except ValueError as e:
        raise ValueError(f"engine argument attention_impl={attention_impl!r} cannot run here: {e}") from None
    return padded_head_dim(head_dim) if kernel == "tpu" else head_dim


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
    def allocate(
        cls, config: ModelConfig, num_pages: int, page_size: int, dtype, head_dim: int | None = None, sharding=None
    ) -> KVCache:
        shape = (config.num_layers, num_pages, page_size, config.num_kv_heads, head_dim or config.head_dim)
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
        # q [T, H, d]; k, v [T, K, d]; the pool's head_dim may be padded
        page_size, head_dim = kv_cache.page_size, kv_cache.k.shape[-1]
        pages, offsets = batch.slot_mapping // page_size, batch.slot_mapping % page_size
        kv_cache = KVCache(
            k=kv_cache.k.at[layer, pages, offsets].set(pad_head_dim(k, head_dim).astype(kv_cache.k.dtype)),
            v=kv_cache.v.at[layer, pages, offsets].set(pad_head_dim(v, head_dim).astype(kv_cache.v.dtype)),
        )
        options = dict(sm_scale=self.sm_scale, sliding_window=self.sliding_window, layer=layer)
        options |= ATTENTION_ARGS[self.impl]
        metadata = (batch.kv_lens, batch.block_tables, batch.cu_q_lens, batch.num_seqs)

        def ragged(q):
            return ragged_paged_attention(q, kv_cache.k, kv_cache.v, *metadata, **options)

        def decode(q):  # every live sequence has one query row: row s is sequence s's
            num_tokens, num_rows = q.shape[0], batch.kv_lens.shape[0]
            live = jnp.arange(num_rows) < batch.num_seqs
            q_rows = jnp.pad(q[:num_rows], ((0, max(num_rows - num_tokens, 0)), (0, 0), (0, 0)))
            kv_lens = jnp.where(live, batch.kv_lens, 0)
            out = paged_attention(q_rows, kv_cache.k, kv_cache.v, kv_lens, batch.block_tables, **options)
            return jnp.pad(out[:num_tokens], ((0, max(num_tokens - num_rows, 0)), (0, 0), (0, 0)))

        if resolve_impl(**ATTENTION_ARGS[self.impl]) == "reference":
            return ragged(q), kv_cache  # (the reference has its own fast path for decode rows)
        # The kernels: a step where every sequence decodes, the common serving step, takes the decode kernel.
        return lax.cond(is_decode_only(batch), decode, ragged, q), kv_cache


def is_decode_only(batch: PagedBatch) -> jax.Array:
    """[] bool: every live sequence of the step has exactly one query row."""
    q_lens = batch.cu_q_lens[1:] - batch.cu_q_lens[:-1]
    live = jnp.arange(q_lens.shape[0]) < batch.num_seqs
    return jnp.all(jnp.where(live, q_lens == 1, True))


def copy_pages(kv_cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copies pages src[i] -> dst[i] in every layer (copy-on-write). src, dst: [C] int32; (0, 0) pairs are no-ops."""
    return KVCache(k=kv_cache.k.at[:, dst].set(kv_cache.k[:, src]), v=kv_cache.v.at[:, dst].set(kv_cache.v[:, src]))
