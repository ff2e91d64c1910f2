"""Ragged paged attention, the public entry point: one call attends a mixed batch of prefill chunks and decodes.

`impl` picks the implementation as `pallas_kernels.impl` says: the XLA implementation (`xla_ragged_attention`, the
CPU path) or a Pallas kernel (`tpu_ragged_attention`, `gpu_ragged_attention`). This file checks the arguments,
brings the pool into the layout the implementation reads, and calls it with that implementation's tuning.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.impl import kernel_operands, kernel_pool_view, padded_head_dim, resolve_impl
from pallas_kernels.kv_quantization import QUANTIZED_KV_DTYPES, is_quantized
from pallas_kernels.xla_ragged_attention import platform_tuning, xla_ragged_attention


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "sliding_window", "max_q_len", "impl", "interpret", "backend", "platform"),
)
def ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]  query tokens of all sequences, back to back (padding at the end)
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]  one layer's K pool
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]  one layer's V pool
    kv_lens: jax.Array,  # [S] int32  tokens in the cache for each sequence, including this step's new tokens
    block_tables: jax.Array,  # [S, pages_per_seq] int32  page ids; unused entries point at page 0 (the null page)
    cu_q_lens: jax.Array,  # [S + 1] int32  sequence s owns query rows [cu_q_lens[s], cu_q_lens[s + 1])
    num_seqs: jax.Array,  # [] int32  rows s >= num_seqs are padding (their q_len and kv_len are 0)
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    max_q_len: int | None = None,
    impl: str = "xla",
    interpret=False,
    backend: str | None = None,
    platform: str | None = None,
) -> jax.Array:
    """Causal attention of each sequence's query rows to its cached keys, through the block tables.

    `impl`, `interpret` and `backend` pick the implementation as `pallas_kernels.impl` says ("xla" by default
    here; the Pallas kernels are `tpu_ragged_attention` and `gpu_ragged_attention`); `platform` is the one the
    program is compiled for (default: jax's default backend).

    The pool's head_dim is q's, or q's padded with zeros to a multiple of 128: the layout the TPU kernels need
    (given an unpadded pool they pad it, a copy per call). The result has q's head_dim.

    With `layer` ([] int32), k_pages and v_pages are the whole stacked pool [num_layers, num_pages, page_size,
    num_kv_heads, head_dim] and the pages of that layer are read in place: slicing one layer out of a pool that
    is carried through a layer loop would make XLA copy the layer's pages on every call.

    8-bit pages (int8, float8_e4m3fn, float8_e5m2; `pallas_kernels.kv_quantization`) come with `k_scales` and
    `v_scales` [num_pages, page_size, num_kv_heads] (with `layer`, [num_layers, ...]): the key of position p is
    `k_pages[page, slot] * k_scales[page, slot][:, None]`. Every implementation dequantizes the tiles it reads,
    never the pool.

    Query row i of sequence s (q_len = cu_q_lens[s + 1] - cu_q_lens[s]) sits at position kv_lens[s] - q_len + i
    and sees the keys at positions 0..that position, or only the last `sliding_window` of them. Position p of
    sequence s lives at `k_pages[block_tables[s, p // page_size], p % page_size]`. Query head h reads kv head
    h // (num_heads // num_kv_heads). Logits are `sm_scale * q.k`, then `soft_cap * tanh(logits / soft_cap)` when
    `soft_cap` is given; softmax and accumulation are in float32.

    `max_q_len` is a promise that no live sequence has more query rows (the XLA implementation then attends the
    last max_q_len rows of all sequences at once and builds no prefill loop; the kernels need no promise).

    Rows past cu_q_lens[num_seqs] and rows that see no key come out as 0. K/V at positions >= kv_len are never
    read into the result, even when they hold NaN. The metadata must be consistent (not checkable on traced
    values): cu_q_lens nondecreasing from cu_q_lens[0] == 0 with cu_q_lens[num_seqs] <= T, and
    q_len <= kv_len <= pages_per_seq * page_size for every live sequence.

    Returns [T, num_heads, head_dim] in q's dtype. Raises ValueError for inconsistent shapes or dtypes.
    """
    check_inputs(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, soft_cap, sliding_window, layer)
    check_scales(k_pages, v_pages, k_scales, v_scales)
    kernel = resolve_impl(impl, interpret, backend, platform)
    head_dim = q.shape[-1]
    q, k_pages, v_pages = kernel_operands(q, k_pages, v_pages, kernel)
    options = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    if kernel == "xla":
        metadata = (kv_lens, block_tables, cu_q_lens, num_seqs, layer, k_scales, v_scales)
        tuning = platform_tuning(platform or jax.default_backend())
        out = xla_ragged_attention(q, k_pages, v_pages, *metadata, **options, **tuning, max_q_len=max_q_len)
        return out[..., :head_dim]
    live = jnp.arange(kv_lens.shape[0]) < num_seqs
    kv_lens = jnp.where(live, kv_lens, 0)
    cu_q_lens = jnp.minimum(cu_q_lens, cu_q_lens[num_seqs])  # padding rows: q_len 0
    if kernel == "tpu":
        from pallas_kernels.tpu_page_pipeline import tpu_pages_per_kv_tile  # Pallas: imported when used
        from pallas_kernels.tpu_ragged_attention import TPU_Q_TILE, tpu_ragged_attention

        pages_per_kv_tile = tpu_pages_per_kv_tile(k_pages.shape[-3])
        pools = (k_pages, v_pages, k_scales, v_scales)
        (k, v, k_scales, v_scales), tables = kernel_pool_view(pools, block_tables, layer, pages_per_kv_tile)
        out = tpu_ragged_attention(
            *(q, k, v, kv_lens, tables, cu_q_lens),
            k_scales=k_scales,
            v_scales=v_scales,
            **options,
            q_tile=TPU_Q_TILE,
            pages_per_kv_tile=pages_per_kv_tile,
            interpret=interpret,
        )
    else:
        from pallas_kernels.gpu_ragged_attention import GPU_PAGES_PER_KV_TILE, gpu_ragged_attention

        pools = (k_pages, v_pages, k_scales, v_scales)
        (k, v, k_scales, v_scales), tables = kernel_pool_view(pools, block_tables, layer, GPU_PAGES_PER_KV_TILE)
        out = gpu_ragged_attention(
            *(q, k, v, kv_lens, tables, cu_q_lens),
            k_scales=k_scales,
            v_scales=v_scales,
            **options,
            interpret=interpret,
        )
    return out[..., :head_dim]


def check_inputs(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, soft_cap, sliding_window, layer):
    """Raises ValueError for the arguments of `ragged_paged_attention` (shapes, dtypes, options) that are wrong."""
    if layer is not None:
        if k_pages.ndim != 5 or v_pages.ndim != 5 or jnp.shape(layer) != ():
            raise ValueError(
                "with layer, k_pages and v_pages must be [num_layers, num_pages, page_size, num_kv_heads, head_dim] "
                f"and layer a scalar; got {k_pages.shape}, {v_pages.shape} and {jnp.shape(layer)}"
            )
        if k_pages.shape[0] != v_pages.shape[0]:
            raise ValueError(f"k_pages and v_pages must have the same shape, got {k_pages.shape} and {v_pages.shape}")
        k_pages = jax.ShapeDtypeStruct(k_pages.shape[1:], k_pages.dtype)
        v_pages = jax.ShapeDtypeStruct(v_pages.shape[1:], v_pages.dtype)
    _check_inputs(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, soft_cap, sliding_window)


def check_scales(k_pages, v_pages, k_scales, v_scales):
    """Raises ValueError unless 8-bit pages come with float scales of the pages' shape without head_dim, and
    floating-point pages without."""
    given = [name for name, x in (("k_scales", k_scales), ("v_scales", v_scales)) if x is not None]
    if len(given) != (2 if is_quantized(k_pages.dtype) else 0):
        raise ValueError(
            f"8-bit pages ({', '.join(d.name for d in QUANTIZED_KV_DTYPES)}) need k_scales and v_scales, other pages "
            f"none; got {k_pages.dtype} pages with {' and '.join(given) or 'no scales'}"
        )
    if k_scales is None:
        return
    for name, x in (("k_scales", k_scales), ("v_scales", v_scales)):
        if x.shape != k_pages.shape[:-1] or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(
                f"{name} must be a floating-point array of the pages' shape without head_dim {k_pages.shape[:-1]}, "
                f"got {x.dtype}{list(x.shape)}"
            )


def _check_inputs(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, soft_cap, sliding_window):
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be a floating-point array, got dtype {q.dtype}")
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not (jnp.issubdtype(x.dtype, jnp.floating) or is_quantized(x.dtype)):
            raise ValueError(f"{name} must be a floating-point or 8-bit (int8, fp8) array, got dtype {x.dtype}")
    if q.ndim != 3:
        raise ValueError(f"q must be [T, num_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [num_pages, page_size, num_kv_heads, head_dim], got shape {k_pages.shape}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must have the same shape, got {k_pages.shape} and {v_pages.shape}")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages must have the same dtype, got {k_pages.dtype} and {v_pages.dtype}")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, kv_head_dim = k_pages.shape[2:]
    if kv_head_dim not in (head_dim, padded_head_dim(head_dim)):
        raise ValueError(
            f"head_dim of the KV pages ({kv_head_dim}) must be q's ({head_dim}) or q's padded to a multiple of 128 "
            f"({padded_head_dim(head_dim)})"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    for name, x in (("kv_lens", kv_lens), ("block_tables", block_tables), ("cu_q_lens", cu_q_lens)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got dtype {x.dtype}")
    if getattr(num_seqs, "dtype", None) != jnp.int32 or num_seqs.shape != ():
        raise ValueError(f"num_seqs must be an int32 scalar array (shape []), got {num_seqs!r}")
    if kv_lens.ndim != 1:
        raise ValueError(f"kv_lens must be [S], got shape {kv_lens.shape}")
    num_seq_rows = kv_lens.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seq_rows:
        raise ValueError(f"block_tables must be [S, pages_per_seq] with S = {num_seq_rows}, got {block_tables.shape}")
    if cu_q_lens.shape != (num_seq_rows + 1,):
        raise ValueError(f"cu_q_lens must be [S + 1] = [{num_seq_rows + 1}], got shape {cu_q_lens.shape}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be positive or None, got {soft_cap}")
    if sliding_window is not None and not sliding_window > 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
