"""Attention over the paged KV pool: the backend interface (`backend`), one class per implementation (`xla`,
`pallas_tpu`, `pallas_gpu`) and the factory that picks one from the engine argument `attention_impl` (`factory`)."""

from jaxpage.attention.backend import (
    QUANTIZED_KV_CACHE_DTYPES,
    AttentionBackend,
    PagedAttention,
    PagedBatch,
)
from jaxpage.attention.factory import BACKENDS, engine_backend, resolve_backend
from jaxpage.attention.pallas_gpu import PallasGpuAttention
from jaxpage.attention.pallas_tpu import PallasTpuAttention
from jaxpage.attention.xla import XlaAttention

__all__ = [
    "BACKENDS",
    "QUANTIZED_KV_CACHE_DTYPES",
    "AttentionBackend",
    "PagedAttention",
    "PagedBatch",
    "PallasGpuAttention",
    "PallasTpuAttention",
    "XlaAttention",
    "engine_backend",
    "resolve_backend",
]
