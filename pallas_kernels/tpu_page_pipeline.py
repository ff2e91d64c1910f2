"""What the TPU (Mosaic) kernels share: double-buffered fetches of kv tiles, one online-softmax step, and the tile size.

The pool stays in HBM (`memory_space=pl.ANY`) in the TPU layout (`impl.tpu_pool_operands`): pages [total_pages,
page_size, num_kv_heads * head_dim], kv head h at lanes [h * head_dim, (h + 1) * head_dim) -- the layout XLA gives
such an array by default, so a pool that is a jitted program's argument reaches the kernel without a relayout
copy (with kv heads as a dimension of their own, XLA's default layout moves page_size below them and Mosaic's
pads them: a copy of the whole pool per call). A kernel copies a kv tile -- `pages_per_kv_tile` whole pages (one
contiguous DMA per page, all kv heads at once) -- into one of two VMEM slots while it computes on the other. A
single 16-token page is too small a DMA to keep HBM busy; a kv tile of 128 keys or more is not. The slots are
[2, pages_per_kv_tile, page_size, num_kv_heads * head_dim] scratch buffers, indexed, never reshaped as refs: one
kv head's keys are read out of a slot as a value.

8-bit pages (int8, fp8; `pallas_kernels.kv_quantization`) come with their scales, one [rows, 128] block per page
(`impl.tpu_scale_rows`), also left in HBM: each page's scales travel with the page, one more DMA per page into
their own slots [2, pages_per_kv_tile, rows, 128] with their own semaphores. The tiles are not dequantized: a kv
head's keys and values are cast to the products' dtype (exact: every 8-bit value is a bfloat16), and the scales
multiply what the products give instead -- the logits by the keys' scales, the probabilities by the values'
scales before they meet the values -- as a [1, kv_tile] lane vector per kv head (`head_scales`). The pool is never
dequantized; HBM traffic stays 8-bit. A kernel takes the pool as the tuple `pools` = (k_pages, v_pages, k_scales,
v_scales), the scales None for float pages: None is an empty pytree, so float pages get exactly the operands,
scratch and DMAs they had before there were scales.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.impl import LANES, MASK_VALUE
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

    pool_hbm: the refs of k_pages, v_pages [total_pages, page_size, num_kv_heads * head_dim] and, for 8-bit pages,
    k_scales, v_scales [total_pages, rows, 128] (HBM; None for float pages); pool_slots: their slots
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


def head_kv_tile(slots, slot, kv_head, head_dim, key_pos, kv_len, dtype):
    """[kv_tile, head_dim]: one kv head's keys (or values) in `slot`, in `dtype`, zeroed at positions >= kv_len.

    slots [2, pages_per_kv_tile, page_size, num_kv_heads * head_dim]; key_pos [kv_tile]. 8-bit pages are cast,
    not scaled (`head_scales`). Zeroed, not only masked: a stale slot may hold NaN, and NaN times a zero
    probability is still NaN."""
    pages_per_kv_tile, page_size = slots.shape[1:3]
    x = slots[slot, :, :, pl.ds(kv_head * head_dim, head_dim)]  # [pages_per_kv_tile, page_size, head_dim]
    if is_quantized(x.dtype):
        # Reshaped in float32, whose (8, 128) vector tiles a page fills: 8-bit ones are (32, 128), 16 tokens half.
        x = x.astype(jnp.float32)
    x = x.reshape(pages_per_kv_tile * page_size, head_dim).astype(dtype)
    return jnp.where(key_pos[:, None] < kv_len, x, jnp.zeros_like(x))


def head_scales(scale_slots, slot, kv_head, first_key, kv_len, page_size: int):
    """[1, kv_tile] float32: one kv head's scales of the keys (or values) in `slot`, key j of the kv tile at
    position first_key + j; 0 at positions >= kv_len.

    scale_slots [2, pages_per_kv_tile, rows, 128]: page i's block holds kv head h's scales of its tokens at
    entries [h * page_size, (h + 1) * page_size) (`impl.tpu_scale_positions`). A block row's scales are moved from
    [page, lane] to the lanes of the keys they belong to by a product with a 0/1 selection matrix [128, kv_tile]
    (exact: one term per result), then each key keeps its own page's row. Entries outside the head's or past
    kv_len are zeroed first: a stale slot's NaN would spread through the product."""
    pages_per_kv_tile, rows = scale_slots.shape[1:3]
    kv_tile = pages_per_kv_tile * page_size
    blocks = scale_slots[slot].astype(jnp.float32).reshape(pages_per_kv_tile * rows, LANES)
    block_row = lax.broadcasted_iota(jnp.int32, blocks.shape, 0)
    block_page = _floor_div(block_row, rows)  # [pages_per_kv_tile * rows, 128]
    row_in_page = block_row - block_page * rows
    key = lax.broadcasted_iota(jnp.int32, (1, kv_tile), 1)
    key_page = _floor_div(key, page_size)  # [1, kv_tile]
    head_entry = kv_head * page_size + key - key_page * page_size  # where key j's scale is in its page's block
    picked = jnp.zeros((pages_per_kv_tile * rows, kv_tile), jnp.float32)
    for row in range(kv_head * page_size // LANES, ((kv_head + 1) * page_size - 1) // LANES + 1):
        entry = row * LANES + lax.broadcasted_iota(jnp.int32, blocks.shape, 1)
        pos = first_key + block_page * page_size + entry - kv_head * page_size
        valid = (row_in_page == row) & (entry >= kv_head * page_size) & (entry < (kv_head + 1) * page_size)
        scales = jnp.where(valid & (pos < kv_len), blocks, 0.0)
        lane = row * LANES + lax.broadcasted_iota(jnp.int32, (LANES, kv_tile), 0)
        select = (lane == head_entry).astype(jnp.float32)  # [128, kv_tile]
        picked += lax.dot_general(
            scales,
            select,
            (((1,), (0,)), ((), ())),
            precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )
    own_page = _floor_div(lax.broadcasted_iota(jnp.int32, picked.shape, 0), rows) == key_page
    return jnp.sum(jnp.where(own_page, picked, 0.0), axis=0, keepdims=True)


def _floor_div(x, d: int):
    """x // d for small non-negative int32 x: through float32 (exact here), which every TPU generation divides."""
    return jnp.floor((x.astype(jnp.float32) + 0.5) * (1.0 / d)).astype(jnp.int32)


def attend(q, keys, values, visible, state, *, sm_scale: float, soft_cap: float | None, scales=(None, None)):
    """Folds one kv tile of keys into the online-softmax state of some query rows.

    q [rows, head_dim] (the kernel's dtype); keys, values [kv_tile, head_dim]; visible [rows, kv_tile]; scales:
    the keys' and the values' [1, kv_tile] float32 (`head_scales`) for 8-bit pages, (None, None) for float pages;
    state (acc [rows, head_dim], row max [rows, 1], row sum [rows, 1]), float32. A row that sees none of the
    tile keeps its state. Logits, statistics and accumulator are float32; the products take the operands'
    dtype (bfloat16 on the MXU) with float32 results, at full precision for float32 operands."""
    acc, row_max, row_sum = state
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    logits = lax.dot_general(
        q, keys, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )  # [rows, kv_tile]
    k_scales, v_scales = scales
    logits = logits * sm_scale if k_scales is None else logits * (sm_scale * k_scales)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(visible, logits, MASK_VALUE)
    new_max = jnp.maximum(row_max, logits.max(axis=1, keepdims=True))
    alpha = jnp.exp(row_max - new_max)
    p = jnp.where(visible, jnp.exp(logits - new_max), 0.0)
    pv = lax.dot_general(
        (p if v_scales is None else p * v_scales).astype(values.dtype),
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


def cost_estimate(q, pools, *, pairs: int, rows: int, keys: int) -> pl.CostEstimate:
    """An upper bound of one kernel call's work, for XLA's cost analysis: `pairs` times, `rows` query rows of
    every head (q [..., num_heads, head_dim]) attend `keys` keys -- two products of 2 * head_dim flops a (row, key)
    and head, one exponential -- whose pages (every array of `pools`) are read from HBM; q is read and the output
    written once."""
    num_heads, head_dim = q.shape[-2:]
    page_size = pools[0].shape[1]
    page_bytes = sum(x[0].size * x.dtype.itemsize for x in pools if x is not None)
    row_keys = pairs * rows * num_heads * keys
    return pl.CostEstimate(
        flops=4 * head_dim * row_keys,
        transcendentals=row_keys,
        bytes_accessed=pairs * -(-keys // page_size) * page_bytes + 2 * q.size * q.dtype.itemsize,
    )
