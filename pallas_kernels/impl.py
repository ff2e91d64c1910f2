"""Which implementation a public attention function runs, and the pool view its Pallas kernels take.

`impl`: "reference" is the pure-JAX code (the CPU path and what the kernels are tested against); "pallas" the
Pallas kernel: natively on GPU (Triton lowering), or in Pallas' generic interpreter with `interpret=True`
anywhere. The TPU (Mosaic) kernels are not written yet. "auto" is "pallas" on GPU and "reference" elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "reference", "pallas")


def resolve_impl(impl: str, interpret: bool) -> str:
    """ "reference" or "pallas"; raises ValueError (NotImplementedError on TPU) where "pallas" cannot run."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    backend = jax.default_backend()
    if impl == "auto":
        return "pallas" if backend == "gpu" else "reference"
    if impl == "pallas" and not interpret and backend != "gpu":
        if backend == "tpu":
            raise NotImplementedError("the Pallas TPU (Mosaic) kernels are not written yet: use impl='reference'")
        raise ValueError(f"impl='pallas' on {backend} needs interpret=True (the GPU kernel in Pallas' interpreter)")
    return impl


def kernel_pool_view(k_pages, v_pages, block_tables, layer, pages_per_block: int):
    """(k, v [total_pages, page_size, kv_heads, head_dim], block_tables) for a kernel.

    With `layer`, one layer of a stacked pool [L, num_pages, ...] is read without a copy: (layer, page) is
    flattened into one page axis and the ids are offset. The tables get null-page columns up to a multiple of
    pages_per_block (positions there are past every kv length: never visible)."""
    if layer is not None:
        num_layers, num_pages = k_pages.shape[:2]
        k_pages = k_pages.reshape(num_layers * num_pages, *k_pages.shape[2:])
        v_pages = v_pages.reshape(num_layers * num_pages, *v_pages.shape[2:])
        block_tables = block_tables + layer * num_pages
    pages_per_seq = block_tables.shape[1]
    padded = -(-pages_per_seq // pages_per_block) * pages_per_block
    return k_pages, v_pages, jnp.pad(block_tables, ((0, 0), (0, padded - pages_per_seq)))
