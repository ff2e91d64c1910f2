"""The Pallas TPU attention backend: the Mosaic kernels (`pallas_kernels.tpu_decode_attention` for decode-only
steps, `pallas_kernels.tpu_ragged_attention` for the others), or those kernels in Pallas' interpreter on any
platform (`interpret`: slow, for tests).

It keeps the pool in the layout the kernels read in place (`jaxpage.attention.tpu_pool`,
`pallas_kernels.tpu_page_pipeline`).
"""

from __future__ import annotations

import dataclasses

from jaxpage.attention.backend import PagedBatch
from jaxpage.attention.tpu_pool import TpuPoolLayout
from jaxpage.kv_cache import KVCache
from pallas_kernels.impl import kernel_pool_view, pad_head_dim


@dataclasses.dataclass(frozen=True)
class PallasTpuAttention(TpuPoolLayout):
    interpret: bool = False  # the kernels in Pallas' interpreter

    @property
    def name(self) -> str:
        return "pallas_tpu_interpret" if self.interpret else "pallas_tpu"

    def attend(
        self, q, kv_cache: KVCache, batch: PagedBatch, layer, *, sm_scale, sliding_window, max_q_len, soft_cap=None
    ):
        """The kernels on the pool in their layout; q's head_dim padded to the pool's, padding rows emptied, the
        block tables offset to the layer (`kernel_pool_view`)."""
        from pallas_kernels.tpu_page_pipeline import tpu_pages_per_kv_tile  # Pallas: imported when used

        head_dim = q.shape[-1]
        q = pad_head_dim(q, self.pool_head_dim(head_dim))
        pages_per_kv_tile = tpu_pages_per_kv_tile(kv_cache.page_size)
        pools, tables = kernel_pool_view(dataclasses.astuple(kv_cache), batch.block_tables, layer, pages_per_kv_tile)
        kv_lens = batch.live_kv_lens()
        k, v, k_scales, v_scales = pools
        options = dict(k_scales=k_scales, v_scales=v_scales, sm_scale=sm_scale, soft_cap=soft_cap)
        options |= dict(sliding_window=sliding_window, pages_per_kv_tile=pages_per_kv_tile, interpret=self.interpret)
        if max_q_len == 1:
            from pallas_kernels.tpu_decode_attention import tpu_decode_attention

            assert q.shape[0] == kv_lens.shape[0], (q.shape, kv_lens.shape)
            out = tpu_decode_attention(q, k, v, kv_lens, tables, **options)
        else:
            from pallas_kernels.tpu_ragged_attention import TPU_Q_TILE, tpu_ragged_attention

            cu_q_lens = batch.live_cu_q_lens()
            out = tpu_ragged_attention(q, k, v, kv_lens, tables, cu_q_lens, **options, q_tile=TPU_Q_TILE)
        return out[..., :head_dim]
