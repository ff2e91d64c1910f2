"""The TPU pool layout, which both attention backends of a TPU keep (`jaxpage.attention.pallas_tpu`, the Mosaic
kernels, and `jaxpage.attention.xla` built for a TPU): K and V [num_layers, num_pages, page_size, num_kv_heads *
head_dim] with head_dim padded with zeros to a multiple of 128 (kv head h at lanes [h * head_dim, (h + 1) *
head_dim)), and the 8-bit pages' scales one [rows, 128] block per page (`pallas_kernels.impl.tpu_scale_rows`).

XLA's TPU compiler lays such arrays out row-major by default, as Mosaic does, so the step's pool argument reaches the
kernels (or the XLA attention's gathers) without a copy. With kv heads as a dimension of their own, [..., page_size,
num_kv_heads, head_dim], a pool whose two minor dimensions would be padded in (8, 128) tiles (3 kv heads x 64 dims:
5x) is laid out with its pages minor instead, and relaid out (copied whole, K and V, in and out) by every forward pass
that gathers or scatters its rows (measured on v5e, v6e, v5p: scripts/compile_for.py).
"""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from jaxpage.attention.backend import AttentionBackend
from jaxpage.config import ModelConfig
from jaxpage.kv_cache import KVCache
from jaxpage.mesh_axes import DATA_AXIS, TP_AXIS
from pallas_kernels import kv_quantization
from pallas_kernels.impl import LANES, padded_head_dim, tpu_scale_rows, tpu_write_scales


@dataclasses.dataclass(frozen=True)
class TpuPoolLayout(AttentionBackend):
    """The pool in the TPU layout (the module docstring): its arrays, their sharding, and writing a step's K/V."""

    tpu_layout = True

    def pool_head_dim(self, head_dim: int) -> int:
        """head_dim padded with zeros to a multiple of 128 (the lane width)."""
        return padded_head_dim(head_dim)

    def _scale_bytes_per_token(self, config: ModelConfig, page_size: int | None, tensor_parallel_size: int) -> int:
        """The scales take whole [rows, 128] blocks per page (and per tensor-parallel shard): given page_size, their
        bytes over the page's tokens, rounded up; without, the scales' own bytes (the pool then takes a little more
        than the figure says)."""
        if page_size is None:
            return super()._scale_bytes_per_token(config, page_size, tensor_parallel_size)
        rows = tpu_scale_rows(page_size, config.num_kv_heads // tensor_parallel_size)
        block_bytes = tensor_parallel_size * rows * LANES * kv_quantization.SCALE_DTYPE.itemsize
        return -(-block_bytes // page_size)

    def pool_layout(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        compute_dtype,
        tensor_parallel_size: int = 1,
        num_layers: int | None = None,
    ) -> KVCache:
        """K and V [num_layers, num_pages, page_size, num_kv_heads * head_dim], scales [num_layers, num_pages,
        tensor_parallel_size * rows, 128]: each shard's kv heads' scales of a page in a block of
        `impl.tpu_scale_rows` rows (`impl.tpu_scale_positions`), so that sharding the rows over the mesh's model
        axis gives every shard the scales of its own kv heads (`pool_specs`)."""
        layers, kv_heads = num_layers or config.num_layers, config.num_kv_heads
        head_dim = self.pool_head_dim(config.head_dim)
        rows = tpu_scale_rows(page_size, kv_heads // tensor_parallel_size)
        pages = (layers, num_pages, page_size, kv_heads * head_dim)
        return self._pool_arrays(pages, (layers, num_pages, tensor_parallel_size * rows, LANES), compute_dtype)

    def pool_specs(self) -> KVCache:
        pages, scales = P(None, DATA_AXIS, None, TP_AXIS), P(None, DATA_AXIS, TP_AXIS, None)
        scales = scales if self.quantized else None
        return KVCache(k=pages, v=pages, k_scales=scales, v_scales=scales)

    def write_kv(self, kv_cache: KVCache, k, v, slot_mapping, layer) -> KVCache:
        """kv heads side by side in each token's row; each page's scales written as its whole block
        (`impl.tpu_write_scales`: a scatter of the scalars would relay the scale arrays out on every step)."""
        num_tokens = k.shape[0]
        page_size = kv_cache.page_size
        pages, offsets = slot_mapping // page_size, slot_mapping % page_size
        (k, k_scales), (v, v_scales) = self._values_and_scales(kv_cache, k), self._values_and_scales(kv_cache, v)

        def write_scales(pool_scales, values):
            return None if values is None else tpu_write_scales(pool_scales, layer, pages, offsets, values, page_size)

        return KVCache(
            k=kv_cache.k.at[layer, pages, offsets].set(k.reshape(num_tokens, -1)),
            v=kv_cache.v.at[layer, pages, offsets].set(v.reshape(num_tokens, -1)),
            k_scales=write_scales(kv_cache.k_scales, k_scales),
            v_scales=write_scales(kv_cache.v_scales, v_scales),
        )
