"""What the TPU (Mosaic) kernels share: double-buffered fetches of kv tiles, one online-softmax step, and the tile size.

The pool stays in HBM (`memory_space=pl.ANY`); a kernel copies a kv tile -- `pages_per_kv_tile` whole pages
([page_size, num_kv_heads, head_dim] each: one contiguous DMA per page, all kv heads at once) -- into one of two
VMEM slots while it computes on the other. A single 16-token page is too small a DMA to keep HBM busy; a kv tile
of 128 keys or more is not. The slots are [2, pages_per_kv_tile, page_size, num_kv_heads, head_dim] scratch
buffers, indexed, never reshaped as refs: one kv head's keys are read out of a slot as a value.

8-bit pages (int8, fp8; `pallas_kernels.kv_quantization`) come with their scales [total_pages, page_size,
num_kv_heads], also left in HBM: each page's scales travel with the page, one more DMA per page into their own
slots [2, pages_per_kv_tile, page_size, num_kv_heads] with their own semaphores, and a kv head's tile is
dequantized in VMEM, in float32, as it is read (`head_kv_tile`). The pool is never dequantized; HBM traffic
stays 8-bit. A kernel takes the pool as the tuple `pools` = (k_pages, v_pages, k_scales, v_scales), the scales
None for float pages: None is an empty pytree, so float pages get exactly the operands, scratch and DMAs they
had before there were scales.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.impl import MASK_VALUE
from pallas_kernels.kv_quantization import is_quantized

TPU_KV_TILE_KEYS = 128  # keys the TPU kernels fetch per step: this many over the page size, whole pages (at least one)
POOL_SPEC = pl.BlockSpec(memory_space=pl.ANY)  # the pool's operand spec: it stays in HBM


def tpu_pages_per_kv_tile(page_size: int) -> int:
    """Pages the TPU kernels fetch per step: TPU_KV_TILE_KEYS keys in whole pages, at least one."""
    return max(1, TPU_KV_TILE_KEYS // page_size)


def compute_dtype(q_dtype, pool_dtype):
    """The dtype of the kernels' products: the pool's for float pages (q is cast to it), q's for 8-bit pages (their
    tiles are dequantized to it)."""
    return jnp.dtype(q_dtype) if is_quantized(pool_dtype) else jnp.dtype(pool_dtype)


def pool_specs(pools) -> tuple:
    """The operand specs of `pools` (k_pages, v_pages, k_scales, v_scales): all in HBM; None (no scales) stays None."""
    return tuple(None if x is None else POOL_SPEC for x in pools)


def scratch(pools, pages_per_kv_tile: int) -> list:
    """The scratch operands `kv_tile_copies` works on: the slots of each array of `pools` (a tuple; None for no
    scales), and DMA semaphores [arrays, 2 (slots)]."""
    slots = tuple(None if x is None else pltpu.VMEM((2, pages_per_kv_tile, *x.shape[1:]), x.dtype) for x in pools)
    return [slots, pltpu.SemaphoreType.DMA((sum(x is not None for x in pools), 2))]


def kv_tile_copies(pool_hbm, pool_slots, sems, tables_ref, first_entry, slot):
    """The DMAs that fill `slot` with the kv tile of pages at tables_ref[first_entry : first_entry + pages_per_kv_tile].

    pool_hbm: the refs of k_pages, v_pages [total_pages, page_size, num_kv_heads, head_dim] and, for 8-bit pages,
    k_scales, v_scales [total_pages, page_size, num_kv_heads] (HBM; None for float pages); pool_slots: their slots
    [2, pages_per_kv_tile, ...] (VMEM); sems [arrays, 2 (slots)] DMA semaphores. Start them all, later wait on them
    all: the copies on one semaphore each have the size of one page of one array, so waiting on each descriptor
    waits out exactly the bytes it brought."""
    arrays = [(hbm, slots) for hbm, slots in zip(pool_hbm, pool_slots, strict=True) if hbm is not None]
    copies = []
    for i in range(pool_slots[0].shape[1]):
        page = tables_ref[first_entry + i]
        for a, (hbm, slots) in enumerate(arrays):
            copies.append(pltpu.make_async_copy(hbm.at[page], slots.at[slot, i], sems.at[a, slot]))
    return copies


def start(copies):
    for copy in copies:
        copy.start()


def wait(copies):
    for copy in copies:
        copy.wait()


def head_kv_tile(slots, scale_slots, slot, kv_head, key_pos, kv_len, dtype):
    """[kv_tile, head_dim]: one kv head's keys (or values) in `slot`, zeroed at positions >= kv_len.

    Float pages are read as they are (`dtype` is theirs); 8-bit pages are dequantized with that head's scales in
    `scale_slots` (None for float pages): in float32, then cast to `dtype`. Zeroed, not only masked: a stale slot
    may hold NaN, and NaN times a zero probability is still NaN; zeroed after dequantizing, since a stale slot's
    scale may be NaN too."""
    pages_per_kv_tile, page_size, _, head_dim = slots.shape[1:]
    x = slots[slot, :, :, kv_head, :]  # [pages_per_kv_tile, page_size, head_dim]
    if scale_slots is not None:
        scales = scale_slots[slot, :, :, pl.ds(kv_head, 1)]  # [pages_per_kv_tile, page_size, 1]
        # Reshaped in float32, whose (8, 128) vector tiles a page fills: 8-bit ones are (32, 128), 16 tokens half.
        x = x.astype(jnp.float32) * scales.astype(jnp.float32)
    x = x.reshape(pages_per_kv_tile * page_size, head_dim).astype(dtype)
    return jnp.where(key_pos[:, None] < kv_len, x, jnp.zeros_like(x))


def attend(q, keys, values, visible, state, *, sm_scale: float, soft_cap: float | None):
    """Folds one kv tile of keys into the online-softmax state of some query rows.

    q [rows, head_dim] (the kernel's dtype); keys, values [kv_tile, head_dim]; visible [rows, kv_tile];
    state (acc [rows, head_dim], row max [rows, 1], row sum [rows, 1]), float32. A row that sees none of the
    tile keeps its state. Logits, statistics and accumulator are float32; the products take the operands'
    dtype (bfloat16 on the MXU) with float32 results, at full precision for float32 operands."""
    acc, row_max, row_sum = state
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    logits = lax.dot_general(
        q, keys, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )  # [rows, kv_tile]
    logits = logits * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(visible, logits, MASK_VALUE)
    new_max = jnp.maximum(row_max, logits.max(axis=1, keepdims=True))
    alpha = jnp.exp(row_max - new_max)
    p = jnp.where(visible, jnp.exp(logits - new_max), 0.0)
    pv = lax.dot_general(
        p.astype(values.dtype),
        values,
        (((1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    return alpha * acc + pv, new_max, alpha * row_sum + p.sum(axis=1, keepdims=True)


def initial_state(rows: int, head_dim: int):
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
    )


def normalized(acc, row_sum):
    """acc / row_sum; rows that saw no key give 0."""
    return acc / jnp.where(row_sum > 0, row_sum, 1.0)
