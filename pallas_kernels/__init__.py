"""Attention over the paged KV pool: Pallas kernels (TPU Mosaic, GPU) and their pure-JAX references."""
