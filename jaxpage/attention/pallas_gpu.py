"""The Pallas GPU attention backend: the Triton kernels (`pallas_kernels.gpu_decode_attention` for decode-only
steps, `pallas_kernels.gpu_ragged_attention` for the others) on the pool as `jaxpage.kv_cache` lays it out, or
those kernels in Pallas' interpreter on any platform (`interpret`: slow, for tests)."""

from __future__ import annotations

import dataclasses

from jaxpage.attention.backend import AttentionBackend, PagedBatch
from jaxpage.config import ModelConfig
from jaxpage.kv_cache import KVCache
from pallas_kernels.impl import kernel_pool_view, triton_misaddresses


@dataclasses.dataclass(frozen=True)
class PallasGpuAttention(AttentionBackend):
    interpret: bool = False  # the kernels in Pallas' interpreter

    @property
    def name(self) -> str:
        return "pallas_gpu_interpret" if self.interpret else "pallas_gpu"

    def addressable_pages(self, config: ModelConfig, num_pages: int, page_size: int, tensor_parallel_size: int = 1):
        """num_pages, or the most pages below it the kernels can address: they read a whole stacked 8-bit pool as
        one array, which their Triton lowering misaddresses between 2 and 4 GiB per device
        (`impl.triton_misaddresses`); such a pool is cut to 2 GiB."""
        if not self.quantized:
            return num_pages
        kv_heads = config.num_kv_heads // tensor_parallel_size
        page_bytes = config.num_layers * page_size * kv_heads * self.pool_head_dim(config.head_dim)  # 1 byte each
        return 2**31 // page_bytes if triton_misaddresses(num_pages * page_bytes, 1) else num_pages

    def attend(
        self, q, kv_cache: KVCache, batch: PagedBatch, layer, *, sm_scale, sliding_window, max_q_len, soft_cap=None
    ):
        options = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, interpret=self.interpret)
        kv_lens, pools = batch.live_kv_lens(), dataclasses.astuple(kv_cache)
        if max_q_len == 1:
            from pallas_kernels.gpu_decode_attention import gpu_decode_attention, gpu_decode_tiling  # Pallas

            assert q.shape[0] == kv_lens.shape[0], (q.shape, kv_lens.shape)
            num_kv_heads, pages_per_seq = kv_cache.k.shape[-2], batch.block_tables.shape[-1]
            num_splits, pages_per_kv_tile = gpu_decode_tiling(q.shape[0] * num_kv_heads, pages_per_seq)
            (k, v, k_scales, v_scales), tables = kernel_pool_view(
                pools, batch.block_tables, layer, num_splits * pages_per_kv_tile
            )
            return gpu_decode_attention(
                *(q, k, v, kv_lens, tables),
                k_scales=k_scales,
                v_scales=v_scales,
                **options,
                num_splits=num_splits,
                pages_per_kv_tile=pages_per_kv_tile,
            )
        from pallas_kernels.gpu_ragged_attention import GPU_PAGES_PER_KV_TILE, gpu_ragged_attention

        (k, v, k_scales, v_scales), tables = kernel_pool_view(pools, batch.block_tables, layer, GPU_PAGES_PER_KV_TILE)
        cu_q_lens = batch.live_cu_q_lens()
        return gpu_ragged_attention(
            *(q, k, v, kv_lens, tables, cu_q_lens),
            k_scales=k_scales,
            v_scales=v_scales,
            **options,
        )
