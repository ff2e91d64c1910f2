"""The dense float64 reference the attention implementations are tested against (not a production path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def ragged_paged_attention_dense_reference(
    q,  # [T, num_heads, head_dim]
    k_pages,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages,  # [num_pages, page_size, num_kv_heads, head_dim]
    kv_lens,  # [S] int32
    block_tables,  # [S, pages_per_seq] int32
    cu_q_lens,  # [S + 1] int32
    num_seqs,  # [] int32
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """`ragged_paged_attention` written plainly: Python loops over concrete values, float64 numpy."""
    out_dtype = q.dtype
    q = np.asarray(q).astype(np.float64)
    k_pages = np.asarray(k_pages).astype(np.float64)
    v_pages = np.asarray(v_pages).astype(np.float64)
    kv_lens, block_tables, cu_q_lens = np.asarray(kv_lens), np.asarray(block_tables), np.asarray(cu_q_lens)
    page_size = k_pages.shape[1]
    group = q.shape[1] // k_pages.shape[2]
    out = np.zeros(q.shape, np.float64)
    for s in range(int(num_seqs)):
        kv_len, q_start, q_end = int(kv_lens[s]), int(cu_q_lens[s]), int(cu_q_lens[s + 1])
        # Contiguous K/V of this sequence: only positions < kv_len are ever read.
        keys = np.array([k_pages[block_tables[s, p // page_size], p % page_size] for p in range(kv_len)])
        values = np.array([v_pages[block_tables[s, p // page_size], p % page_size] for p in range(kv_len)])
        for i, row in enumerate(range(q_start, q_end)):
            pos = kv_len - (q_end - q_start) + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            seen = np.arange(lo, pos + 1)
            if seen.size == 0:
                continue
            for h in range(q.shape[1]):
                logits = sm_scale * keys[seen, h // group] @ q[row, h]
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                weights = np.exp(logits - logits.max())
                out[row, h] = weights @ values[seen, h // group] / weights.sum()
    return jnp.asarray(out.astype(out_dtype))
