"""The XLA attention backend: `pallas_kernels.xla_ragged_attention` in plain JAX, on the pool as `jaxpage.kv_cache`
lays it out, or on a TPU in the TPU layout (`XlaTpuAttention`). The CPU path, and any platform's fallback."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxpage.attention.backend import AttentionBackend, PagedBatch
from jaxpage.attention.tpu_pool import TpuPoolLayout
from jaxpage.kv_cache import KVCache
from pallas_kernels.impl import pad_head_dim
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
        head_dim = q.shape[-1]
        q = pad_head_dim(q, self.pool_head_dim(head_dim))  # the TPU layout's padded head_dim (else q itself)
        pools = (kv_cache.k, kv_cache.v)
        scales = dict(k_scales=kv_cache.k_scales, v_scales=kv_cache.v_scales)
        options = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, max_q_len=max_q_len)
        options |= platform_tuning(self.platform) | dict(fixed_order=self.batch_invariant, tpu_layout=self.tpu_layout)
        if max_q_len == 1:  # one query token per row: sequence s's is token s (the decode form, no prefill loop)
            assert q.shape[0] == batch.kv_lens.shape[0], (q.shape, batch.kv_lens.shape)
            rows = q.shape[0]
            metadata = (
                batch.live_kv_lens(),
                batch.block_tables,
                jnp.arange(rows + 1, dtype=jnp.int32),
                jnp.int32(rows),
            )
        else:
            metadata = (batch.kv_lens, batch.block_tables, batch.cu_q_lens, batch.num_seqs)
        return xla_ragged_attention(q, *pools, *metadata, layer, **scales, **options)[..., :head_dim]


@dataclasses.dataclass(frozen=True)
class XlaTpuAttention(TpuPoolLayout, XlaAttention):
    """XlaAttention built for a TPU: the pool in the TPU layout (jaxpage.attention.tpu_pool), which the TPU compiler
    keeps row-major; in the XLA backend's own layout a pool like SmolLM2's (3 kv heads x 64) is laid out pages-minor
    and copied whole, in and out, by every forward pass (measured on v5e: tests/test_compile_for.py)."""


def xla_backend_class(platform: str) -> type[XlaAttention]:
    """The XLA attention backend's class for programs built for `platform`."""
    return XlaTpuAttention if platform == "tpu" else XlaAttention
