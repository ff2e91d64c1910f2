"""Moved to the package `jaxpage.attention` (one class per attention backend); kept so that imports from here
keep working."""

from jaxpage.attention import (  # noqa: F401
    BACKENDS,
    QUANTIZED_KV_CACHE_DTYPES,
    AttentionBackend,
    PagedAttention,
    PagedBatch,
)
from jaxpage.config import KV_CACHE_DTYPE_ALIASES  # noqa: F401
