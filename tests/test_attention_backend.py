"""The paged attention the model layers call: it writes the step's K/V into the pool, then attends through the
block tables with the engine's attention_impl. With a Pallas kernel, decode-only steps take the decode kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ragged_paged_attention import CASES, GQA, make_batch

from jaxpage.kv_cache import KVCache, PagedAttention, PagedBatch, is_decode_only, pool_head_dim
from pallas_kernels.impl import pad_head_dim

DECODES = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 100)]
MIXED = CASES["mixed"](GQA.page_size)


def step(seqs, seed=0):
    """(q, k, v, PagedBatch, KVCache) of one step: each sequence's new tokens are its last q_len positions."""
    batch = make_batch(GQA, seqs, seed=seed, poison=True)
    p = GQA.page_size
    tables = np.asarray(batch.block_tables)
    slots = np.zeros(batch.q.shape[0], np.int32)  # padding tokens write into the null page
    row = 0
    for s, (q_len, kv_len) in enumerate(seqs):
        for pos in range(kv_len - q_len, kv_len):
            slots[row] = tables[s, pos // p] * p + pos % p
            row += 1
    rng = np.random.default_rng(seed + 1)
    k, v = (
        jnp.asarray(rng.standard_normal((batch.q.shape[0], GQA.num_kv_heads, GQA.head_dim)), GQA.dtype) for _ in "kv"
    )
    paged = PagedBatch(jnp.asarray(slots), batch.block_tables, batch.kv_lens, batch.cu_q_lens, batch.num_seqs)
    return batch.q, k, v, paged, KVCache(k=batch.k_pages[None], v=batch.v_pages[None])


@pytest.mark.parametrize(
    ("seqs", "num_seqs", "decode_only"),
    [(DECODES, None, True), (MIXED, None, False), (MIXED, 1, True), (MIXED, 0, True), ([(2, 5)], None, False)],
)
def test_is_decode_only(seqs, num_seqs, decode_only):
    _, _, _, batch, _ = step(seqs)
    if num_seqs is not None:  # the same rows, fewer of them live
        batch = PagedBatch(batch.slot_mapping, batch.block_tables, batch.kv_lens, batch.cu_q_lens, jnp.int32(num_seqs))
    assert bool(is_decode_only(batch)) == decode_only


@pytest.mark.parametrize("impl", ["pallas_tpu_interpret", "pallas_gpu_interpret"])
@pytest.mark.parametrize("seqs", [DECODES, MIXED], ids=["decode-only", "mixed"])
def test_kernels_match_the_reference(impl, seqs):
    q, k, v, batch, kv_cache = step(seqs)
    attention = jax.jit(lambda impl, *args: PagedAttention(0.2, None, impl)(*args), static_argnums=0)
    want, want_cache = attention("reference", q, k, v, batch, kv_cache, jnp.int32(0))
    head_dim = pool_head_dim(GQA.head_dim, impl)  # 128 for the TPU kernel: the engine allocates the pool padded
    padded = KVCache(k=pad_head_dim(kv_cache.k, head_dim), v=pad_head_dim(kv_cache.v, head_dim))
    got, got_cache = attention(impl, q, k, v, batch, padded, jnp.int32(0))
    assert got_cache.k.shape[-1] == head_dim
    for got_pool, want_pool in ((got_cache.k, want_cache.k), (got_cache.v, want_cache.v)):
        np.testing.assert_array_equal(np.asarray(got_pool[..., : GQA.head_dim]), np.asarray(want_pool))
        assert (np.asarray(got_pool[..., GQA.head_dim :]) == 0).all()
    got, want = np.asarray(got), np.asarray(want)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-5)
