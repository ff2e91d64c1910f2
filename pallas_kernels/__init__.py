"""Attention over the paged KV pool: Pallas kernels (TPU Mosaic, GPU) and their pure-JAX references."""

from pallas_kernels.ragged_paged_attention import ragged_paged_attention as ragged_paged_attention
