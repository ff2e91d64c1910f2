"""Which implementation a public attention function runs, and what its Pallas kernels share.

`impl`: "xla" is the XLA implementation in plain JAX (`xla_ragged_attention`, the CPU path); "pallas" a Pallas
kernel: the Mosaic kernel on TPU, the Triton kernel on GPU. Either kernel also runs anywhere in Pallas' generic
interpreter (`interpret=True`, then `backend` says which kernel), and the TPU kernel in Pallas' TPU interpret mode
(`interpret=pltpu.InterpretParams(...)`), which checks DMAs and can detect races. "auto" is the kernel of the
backend jax runs on, and the XLA implementation on CPU.

`platform` is the platform the program is compiled for: jax's default backend unless the caller compiles for
another one (a TPU or GPU target's compile-only devices: `jaxpage.targets`), where a kernel is built without
running it.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

IMPLS = ("auto", "xla", "pallas")
KERNEL_BACKENDS = ("tpu", "gpu")
LANES = 128  # TPU vector lanes: the TPU kernels need the pool's head_dim padded to a multiple
# The kernels' "minus infinity" for masked logits: finite, so exp(MASK - MASK) = 1 keeps the online softmax free of
# NaN for rows that have seen no key yet (their probabilities are zeroed by the mask, not by the exponential).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def resolve_impl(impl: str, interpret=False, backend: str | None = None, platform: str | None = None) -> str:
    """ "xla", "tpu" or "gpu" (which implementation) for the arguments, in a program compiled for `platform`
    (default: jax's default backend); ValueError where they cannot run there."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if backend is not None and backend not in KERNEL_BACKENDS:
        raise ValueError(f"backend must be None or one of {KERNEL_BACKENDS}, got {backend!r}")
    if not isinstance(interpret, bool) and _is_tpu_interpret_params(interpret):
        if backend == "gpu":
            raise ValueError("TPU interpret mode (interpret=pltpu.InterpretParams()) runs the TPU kernel, not 'gpu'")
        backend = "tpu"
    platform = platform or jax.default_backend()
    native = platform if platform in KERNEL_BACKENDS else None
    if impl == "xla" or (impl == "auto" and native is None):
        return "xla"
    if impl == "auto":
        return native
    kernel = backend or native
    if kernel is None:
        raise ValueError(
            f"impl='pallas' on {platform} runs a kernel in Pallas' interpreter: pass interpret=True and "
            "backend='tpu' or 'gpu'"
        )
    if kernel != platform and not interpret:
        raise ValueError(f"the {kernel} kernel on {platform} needs interpret=True (Pallas' interpreter)")
    return kernel


def padded_head_dim(head_dim: int) -> int:
    return -(-head_dim // LANES) * LANES


def pad_head_dim(x: jax.Array, head_dim: int) -> jax.Array:
    """x [..., d] with zero columns up to head_dim (x itself when d == head_dim)."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, head_dim - x.shape[-1])])


def kernel_operands(q, k_pages, v_pages, kernel: str):
    """(q, k_pages, v_pages) with q's head_dim padded to the pool's, and for the TPU kernel the pool's to a
    multiple of 128 -- a copy of the pool per call: allocate it padded instead (jaxpage's engine does)."""
    if kernel == "tpu" and k_pages.shape[-1] % LANES:
        warnings.warn(
            f"the TPU kernels need the KV pool's head_dim padded to a multiple of {LANES}; padding "
            f"{k_pages.shape[-1]} on every call copies the pool",
            stacklevel=3,
        )
        head_dim = padded_head_dim(k_pages.shape[-1])
        k_pages, v_pages = pad_head_dim(k_pages, head_dim), pad_head_dim(v_pages, head_dim)
    return pad_head_dim(q, k_pages.shape[-1]), k_pages, v_pages


def kernel_pool_view(pools: tuple, block_tables, layer, pages_per_kv_tile: int):
    """(pools, block_tables) as a kernel reads them: pools (k, v, and any 8-bit pages' k_scales, v_scales; None
    stays None) each [total_pages, page_size, ...].

    With `layer`, one layer of a stacked pool [L, num_pages, ...] is read without a copy: (layer, page) is
    flattened into one page axis and the ids are offset. The tables get null-page columns up to a multiple of
    pages_per_kv_tile (positions there are past every kv length: never visible)."""
    if layer is not None:
        num_pages = pools[0].shape[1]
        pools = tuple(None if x is None else x.reshape(-1, *x.shape[2:]) for x in pools)
        block_tables = block_tables + layer * num_pages
    pages_per_seq = block_tables.shape[1]
    padded = -(-pages_per_seq // pages_per_kv_tile) * pages_per_kv_tile
    return pools, jnp.pad(block_tables, ((0, 0), (0, padded - pages_per_seq)))


def _is_tpu_interpret_params(interpret) -> bool:
    # Imported here: Pallas' modules take a few hundred milliseconds to import, which the XLA path never needs.
    from jax.experimental.pallas import tpu as pltpu

    return isinstance(interpret, pltpu.InterpretParams)
