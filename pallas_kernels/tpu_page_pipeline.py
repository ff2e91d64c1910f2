"""What the TPU (Mosaic) kernels share: double-buffered fetches of several pages, and one online-softmax step.

The pool stays in HBM (`memory_space=pl.ANY`); a kernel copies `pages_per_block` whole pages ([page_size,
num_kv_heads, head_dim] each: one contiguous DMA per page, all kv heads at once) into one of two VMEM slots
while it computes on the other. A single 16-token page is too small a DMA to keep HBM busy; a block of pages
(128 keys or more) is not. The slots are [2, pages_per_block, page_size, num_kv_heads, head_dim] scratch
buffers, indexed, never reshaped as refs: one kv head's keys are read out of a slot as a value.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.impl import MASK_VALUE

POOL_SPEC = pl.BlockSpec(memory_space=pl.ANY)  # the pool's operand spec: it stays in HBM


def scratch(k_pages, pages_per_block: int) -> list:
    """The scratch operands `block_copies` works on: K slots, V slots, DMA semaphores."""
    slots = pltpu.VMEM((2, pages_per_block, *k_pages.shape[1:]), k_pages.dtype)
    return [slots, slots, pltpu.SemaphoreType.DMA((2, 2))]


def block_copies(k_hbm, v_hbm, k_slots, v_slots, sems, tables_ref, first_entry, slot):
    """The DMAs that fill `slot` with the pages at tables_ref[first_entry : first_entry + pages_per_block].

    k_hbm, v_hbm [total_pages, page_size, num_kv_heads, head_dim] (HBM); k_slots, v_slots [2, pages_per_block,
    ...] (VMEM); sems [2 (k, v), 2 (slots)] DMA semaphores. Start them all, later wait on them all: every copy
    has the size of one page, so waiting on each descriptor waits out exactly the bytes it brought."""
    copies = []
    for i in range(k_slots.shape[1]):
        page = tables_ref[first_entry + i]
        copies.append(pltpu.make_async_copy(k_hbm.at[page], k_slots.at[slot, i], sems.at[0, slot]))
        copies.append(pltpu.make_async_copy(v_hbm.at[page], v_slots.at[slot, i], sems.at[1, slot]))
    return copies


def start(copies):
    for copy in copies:
        copy.start()


def wait(copies):
    for copy in copies:
        copy.wait()


def head_block(slots, slot, kv_head, key_pos, kv_len):
    """[block_keys, head_dim]: one kv head's keys (or values) in `slot`, zeroed at positions >= kv_len.

    Zeroed, not only masked: a stale slot may hold NaN, and NaN times a zero probability is still NaN."""
    pages_per_block, page_size, _, head_dim = slots.shape[1:]
    x = slots[slot, :, :, kv_head, :].reshape(pages_per_block * page_size, head_dim)
    return jnp.where(key_pos[:, None] < kv_len, x, jnp.zeros_like(x))


def attend(q, keys, values, visible, state, *, sm_scale: float, soft_cap: float | None):
    """Folds one block of keys into the online-softmax state of some query rows.

    q [rows, head_dim] (the kernel's dtype); keys, values [block_keys, head_dim]; visible [rows, block_keys];
    state (acc [rows, head_dim], row max [rows, 1], row sum [rows, 1]), float32. A row that sees none of the
    block keeps its state. Logits, statistics and accumulator are float32; the products take the operands'
    dtype (bfloat16 on the MXU) with float32 results, at full precision for float32 operands."""
    acc, row_max, row_sum = state
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    logits = lax.dot_general(
        q, keys, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )  # [rows, block_keys]
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
