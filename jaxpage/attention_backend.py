"""The attention backend: resolved once, at engine start, from the engine argument `attention_impl`.

It owns what only attention should know -- the KV pool's shape (head_dim padded where a kernel needs it), writing
a step's new K/V into the pool, and attending through the block tables -- so that the engine, the runner and the
config never branch on backends:

    "xla"                   the XLA implementation (pure JAX): the CPU path, and any backend's fallback
    "pallas_tpu"            the Pallas Mosaic kernels (TPU)
    "pallas_gpu"            the Pallas GPU kernels
    "pallas_tpu_interpret"  the TPU kernels in Pallas' interpreter, on any backend (slow: for tests)
    "pallas_gpu_interpret"  the GPU kernels in Pallas' interpreter, on any backend (slow: for tests)

`attention_impl` "auto" is the kernels of the platform jax runs on (TPU, GPU), else "xla"; "pallas" is the
platform's kernels, refused where there are none.

The most query rows any sequence of a step has is known on the host and passed as a static argument `max_q_len`:
1 for a decode-only step (it compiles only the decode attention), k + 1 for a step that verifies k speculative
tokens per sequence (the ragged attention, told that no sequence has more rows), None for a mixed step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpage.config import ModelConfig
from jaxpage.kv_cache import KVCache
from pallas_kernels.impl import pad_head_dim, padded_head_dim
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

BACKENDS = ("xla", "pallas_tpu", "pallas_gpu", "pallas_tpu_interpret", "pallas_gpu_interpret")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """Attention metadata of one ragged step (T tokens of S sequences, padded to the step's shape)."""

    slot_mapping: jax.Array  # [T] int32, page * page_size + offset where each token's K/V goes (0 for padding)
    block_tables: jax.Array  # [S, P] int32, pages of each sequence (0 past its end)
    kv_lens: jax.Array  # [S] int32, cached tokens of each sequence after this step (0 for padding rows)
    cu_q_lens: jax.Array  # [S + 1] int32, sequence s owns tokens [cu_q_lens[s], cu_q_lens[s + 1])
    num_seqs: jax.Array  # [] int32, real sequences; rows past it are padding


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """One of BACKENDS; hashable (it is part of the jitted step's static structure)."""

    name: str

    def __post_init__(self):
        assert self.name in BACKENDS, self.name

    @classmethod
    def resolve(cls, attention_impl: str = "auto") -> AttentionBackend:
        """The backend for the engine argument; ValueError where it cannot run on this platform."""
        platform = jax.default_backend()
        native = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(platform)
        if attention_impl == "auto":
            return cls(native or "xla")
        if attention_impl == "pallas":
            if native is None:
                raise ValueError(
                    f"engine argument attention_impl='pallas' cannot run on {platform}: there are no Pallas kernels "
                    "for it (use 'auto', 'xla', or 'pallas_tpu_interpret' / 'pallas_gpu_interpret' for tests)"
                )
            return cls(native)
        if attention_impl in ("pallas_tpu", "pallas_gpu") and attention_impl != native:
            raise ValueError(
                f"engine argument attention_impl={attention_impl!r} cannot run on {platform} "
                f"(use {attention_impl}_interpret for Pallas' interpreter)"
            )
        if attention_impl not in BACKENDS:
            raise ValueError(f"engine argument attention_impl must be 'auto', 'pallas' or one of {BACKENDS}")
        return cls(attention_impl)

    @property
    def _kernel_args(self) -> dict:
        """The attention functions' impl / interpret / backend arguments."""
        if self.name == "xla":
            return dict(impl="xla")
        kernel = self.name.split("_")[1]  # "tpu" or "gpu"
        return dict(impl="pallas", interpret=self.name.endswith("_interpret"), backend=kernel)

    def pool_head_dim(self, head_dim: int) -> int:
        """The pool's head_dim: the TPU kernels need it padded with zeros to a multiple of 128 (the lane width)."""
        return padded_head_dim(head_dim) if self.name.startswith("pallas_tpu") else head_dim

    def kv_bytes_per_token(self, config: ModelConfig, dtype_bytes: int) -> int:
        """2 * layers * kv_heads * head_dim * dtype_bytes, with the pool's (padded) head_dim."""
        return config.kv_bytes_per_token(dtype_bytes) // config.head_dim * self.pool_head_dim(config.head_dim)

    def pool_shape(self, config: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
        """[num_layers, num_pages, page_size, num_kv_heads, head_dim] with the pool's head_dim."""
        return (config.num_layers, num_pages, page_size, config.num_kv_heads, self.pool_head_dim(config.head_dim))

    def write_kv(self, kv_cache: KVCache, k, v, slot_mapping, layer) -> KVCache:
        """The step's new K/V ([T, kv_heads, head_dim] each) into layer `layer` of the pool at slot_mapping [T]."""
        page_size, head_dim = kv_cache.page_size, kv_cache.k.shape[-1]
        pages, offsets = slot_mapping // page_size, slot_mapping % page_size
        return KVCache(
            k=kv_cache.k.at[layer, pages, offsets].set(pad_head_dim(k, head_dim).astype(kv_cache.k.dtype)),
            v=kv_cache.v.at[layer, pages, offsets].set(pad_head_dim(v, head_dim).astype(kv_cache.v.dtype)),
        )

    def attend(
        self,
        q: jax.Array,  # [T, num_heads, head_dim]
        kv_cache: KVCache,
        batch: PagedBatch,
        layer: jax.Array,  # [] int32
        *,
        sm_scale: float,
        sliding_window: int | None,
        max_q_len: int | None,
    ) -> jax.Array:  # [T, num_heads, head_dim]
        """Causal attention of the step's query tokens to their sequences' cached keys (this step's included).

        max_q_len (static): no live sequence has more query tokens than this (None: any number). With 1, every
        live sequence has one query token, token s being sequence s's, and T == S."""
        options = dict(sm_scale=sm_scale, sliding_window=sliding_window, layer=layer, **self._kernel_args)
        if max_q_len == 1:
            assert q.shape[0] == batch.kv_lens.shape[0], (q.shape, batch.kv_lens.shape)
            live = jnp.arange(batch.kv_lens.shape[0]) < batch.num_seqs
            kv_lens = jnp.where(live, batch.kv_lens, 0)
            return paged_attention(q, kv_cache.k, kv_cache.v, kv_lens, batch.block_tables, **options)
        metadata = (batch.kv_lens, batch.block_tables, batch.cu_q_lens, batch.num_seqs)
        return ragged_paged_attention(q, kv_cache.k, kv_cache.v, *metadata, **options, max_q_len=max_q_len)


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """What the model's layers call (see jaxpage.models.attention): write K/V into the pool, then attend."""

    backend: AttentionBackend
    sm_scale: float
    sliding_window: int | None = None
    max_q_len: int | None = None  # see AttentionBackend.attend

    def __call__(self, q, k, v, batch: PagedBatch, kv_cache: KVCache, layer):
        # q [T, H, d]; k, v [T, K, d]
        kv_cache = self.backend.write_kv(kv_cache, k, v, batch.slot_mapping, layer)
        out = self.backend.attend(
            q,
            kv_cache,
            batch,
            layer,
            sm_scale=self.sm_scale,
            sliding_window=self.sliding_window,
            max_q_len=self.max_q_len,
        )
        return out, kv_cache
