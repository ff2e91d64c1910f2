"""Attention over the paged KV pool: an XLA implementation (the CPU path) and Pallas kernels (TPU Mosaic, GPU).

Public entry points, each with an `impl` argument ("auto", "xla", "pallas"; see `impl`):
  ragged_paged_attention  a mixed batch of prefill chunks and decodes (`ragged_paged_attention.py`)
  paged_attention         a decode batch, one query row per sequence (`paged_attention.py`)
Implementations: `xla_ragged_attention.py` (plain JAX; with max_q_len=1 the decode path),
`tpu_ragged_attention.py` and `tpu_decode_attention.py` (sharing `tpu_page_pipeline.py`), `gpu_ragged_attention.py`
and `gpu_decode_attention.py` (sharing `gpu_online_softmax.py`). Each file holds its own tuning constants.

Words: a page is a fixed-size piece of the KV pool (`page_size` token positions); a sequence's block table maps
its logical positions to pages. A kv tile is the keys (whole pages, `pages_per_kv_tile` of them) an implementation
reads per step; a query tile is the query rows (`q_tile`) it attends together.
"""

from pallas_kernels.paged_attention import paged_attention as paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention as ragged_paged_attention
