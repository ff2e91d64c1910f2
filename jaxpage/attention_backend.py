"""Moved to the package `jaxpage.attention` (one class per attention backend); kept so that imports from here
keep working."""

from jaxpage.attention import (  # noqa: F401
    BACKENDS,
    KV_CACHE_DTYPE_ALIASES,
    QUANTIZED_KV_CACHE_DTYPES,
    AttentionBackend,
    PagedAttention,
    PagedBatch,
)
