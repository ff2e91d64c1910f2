"""The XLA attention backend: `pallas_kernels.xla_ragged_attention` in plain JAX, on the pool as `jaxpage.kv_cache`
lays it out. The CPU path, and any platform's fallback."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxpage.attention.backend import AttentionBackend, PagedBatch
from jaxpage.kv_cache import KVCache
from pallas_kernels.xla_ragged_attention import platform_tuning, xla_ragged_attention


@dataclasses.dataclass(frozen=True)
class XlaAttention(AttentionBackend):
    # Every query row's products and sums in one order whatever else the step holds (engine argument batch_invariant:
    # xla_ragged_attention's fixed_order).
    batch_invariant: bool = False

    @property
    def name(self) -> str:
        return "xla"

    def attend(
        self, q, kv_cache: KVCache, batch: PagedBatch, layer, *, sm_scale, sliding_window, max_q_len, soft_cap=None
    ):
        pools = (kv_cache.k, kv_cache.v)
        scales = dict(k_scales=kv_cache.k_scales, v_scales=kv_cache.v_scales)
        options = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, max_q_len=max_q_len)
        options |= platform_tuning(self.platform) | dict(fixed_order=self.batch_invariant)
        if max_q_len == 1:  # one query token per row: sequence s's is token s (the decode form, no prefill loop)
            assert q.shape[0] == batch.kv_lens.shape[0], (q.shape, batch.kv_lens.shape)
            rows = q.shape[0]
            metadata = (batch.live_kv_lens(), batch.block_tables, jnp.arange(rows + 1, dtype=jnp.int32))
            return xla_ragged_attention(q, *pools, *metadata, jnp.int32(rows), layer, **scales, **options)
        metadata = (batch.kv_lens, batch.block_tables, batch.cu_q_lens, batch.num_seqs)
        return xla_ragged_attention(q, *pools, *metadata, layer, **scales, **options)
