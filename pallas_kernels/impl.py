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


def triton_misaddresses(nbytes: int, itemsize: int) -> bool:
    """Whether the GPU kernels' Triton lowering addresses an array of nbytes bytes of itemsize-byte elements
    wrongly: it computes element offsets in int32 unless the array takes more than 4 GiB, and Triton adds them
    signed, so a 1-byte array of (2, 4] GiB has offsets past 2**31 that wrap negative."""
    return itemsize == 1 and 2**31 < nbytes <= 2**32


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
    stays None) each [total_pages, ...] (the page axis first, whatever the layout after it).

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


def tpu_scale_rows(page_size: int, num_kv_heads: int) -> int:
    """Rows of 128 lanes that hold one page's scales (page_size * num_kv_heads of them) in the TPU pool layout.

    A page's scales are one block [rows, 128] that its own DMA brings: Mosaic slices HBM only at whole tiles of the
    two minor dimensions, and the tiles that XLA's default layout and Mosaic agree on (measured on v5e, v6e, v5p:
    no relayout copy) are (2, 128), (4, 128) and multiples of 8 rows; one row (1, 128) of bfloat16 is relaid out."""
    rows = -(-page_size * num_kv_heads // LANES)
    return 2 if rows <= 2 else 4 if rows <= 4 else -(-rows // 8) * 8


def tpu_scale_positions(offsets: jax.Array, num_kv_heads: int, page_size: int) -> tuple[jax.Array, jax.Array]:
    """(rows, lanes) [T, num_kv_heads] of the scales of tokens at page offsets [T] in a page's [rows, 128] scale
    block of the TPU pool layout: kv head h's scales are entries [h * page_size, (h + 1) * page_size) of the block
    read row after row (head-major: a head's scales of one page are consecutive lanes)."""
    entry = jnp.arange(num_kv_heads)[None, :] * page_size + offsets[:, None]
    return entry // LANES, entry % LANES


def tpu_block_scales(blocks: jax.Array, num_kv_heads: int, page_size: int) -> jax.Array:
    """The scales [..., page_size, num_kv_heads] of pages' [..., rows, 128] scale blocks in the TPU pool layout (read
    as tpu_scale_positions places them: head-major, row after row)."""
    entries = blocks.reshape(*blocks.shape[:-2], -1)[..., : num_kv_heads * page_size]
    return entries.reshape(*blocks.shape[:-2], num_kv_heads, page_size).swapaxes(-1, -2)


def tpu_write_scales(
    scales: jax.Array, layer, pages: jax.Array, offsets: jax.Array, values: jax.Array, page_size: int
) -> jax.Array:
    """scales [L, num_pages, rows, 128] (the TPU pool layout's 8-bit scales) with values [T, num_kv_heads] written
    for the step's tokens at (pages, offsets) [T] of layer `layer`, as whole [rows, 128] page blocks.

    Tokens that write into one page must be consecutive in the step: a sequence's new tokens are, and no two
    sequences write into one page (the null page aside, which nothing reads). Each page's block is read once,
    updated with its tokens' scales, and written back whole. A scatter of the scalars instead makes XLA's TPU
    layout assignment relay out the whole scale array ([L, P, 2, 128] -> layers second-minor, for (8, 128) tiles)
    on every step when there are few of them (<= 64 tokens of 8 kv heads, 32 layers: measured on v5e, v6e, v5p)."""
    num_kv_heads = values.shape[1]
    token = jnp.arange(pages.shape[0])
    first = jnp.concatenate([jnp.ones(1, bool), pages[1:] != pages[:-1]])
    run_start = jax.lax.cummax(jnp.where(first, token, 0))  # the first token writing into each token's page
    rows, lanes = tpu_scale_positions(offsets, num_kv_heads, page_size)
    blocks = scales[layer, pages].at[run_start[:, None], rows, lanes].set(values.astype(scales.dtype))
    return scales.at[layer, pages].set(blocks[run_start])


def tpu_pool_operands(pools: tuple, head_dim: int) -> tuple:
    """`pools` (k_pages, v_pages, k_scales, v_scales; None stays None) in the TPU kernels' layout: pages
    [total_pages, page_size, num_kv_heads * head_dim] (kv head h at lanes [h * head_dim, (h + 1) * head_dim)),
    scales [total_pages, tpu_scale_rows, 128] (`tpu_scale_positions`).

    Pools already in that layout (3-D pages: what jaxpage's TPU backend allocates) are returned as they are. Pools
    in the public functions' view (pages [total_pages, page_size, num_kv_heads, head_dim], scales [total_pages,
    page_size, num_kv_heads]) are reshaped and relaid out: a copy of the whole pool on every call where it is a
    program's argument (XLA's default layout of such pages puts page_size below num_kv_heads; measured on v5e),
    which is why jaxpage's TPU backend allocates the TPU layout and calls the kernels with it."""
    k_pages, v_pages, k_scales, v_scales = pools
    if k_pages.ndim == 3:
        return pools
    total_pages, page_size, num_kv_heads, _ = k_pages.shape
    rows = tpu_scale_rows(page_size, num_kv_heads)

    def scales_layout(x):  # [total_pages, page_size, num_kv_heads] -> [total_pages, rows, 128]
        x = x.transpose(0, 2, 1).reshape(total_pages, num_kv_heads * page_size)
        return jnp.pad(x, ((0, 0), (0, rows * LANES - x.shape[1]))).reshape(total_pages, rows, LANES)

    pages = (x.reshape(total_pages, page_size, num_kv_heads * head_dim) for x in (k_pages, v_pages))
    scales = (None if x is None else scales_layout(x) for x in (k_scales, v_scales))
    return (*pages, *scales)


def _is_tpu_interpret_params(interpret) -> bool:
    # Imported here: Pallas' modules take a few hundred milliseconds to import, which the XLA path never needs.
    from jax.experimental.pallas import tpu as pltpu

    return isinstance(interpret, pltpu.InterpretParams)
