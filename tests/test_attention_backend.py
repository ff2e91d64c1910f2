"""The attention backend: chosen once from attention_impl; it owns the pool's shape, the K/V write and attending.
Every backend writes the same pool and gives the same attention as the XLA backend, for decode-only steps (the
decode kernels), verify steps (a few query rows per sequence, max_q_len) and mixed ones (the ragged kernels)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ragged_paged_attention import CASES, GQA, make_batch

from jaxpage.attention_backend import AttentionBackend, PagedAttention, PagedBatch
from jaxpage.config import ModelConfig
from jaxpage.kv_cache import KVCache
from pallas_kernels.impl import pad_head_dim

DECODES = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 100)]
VERIFIES = [(5, 5), (1, 15), (5, 16), (3, 17), (5, 100), (2, 40)]  # k + 1 = 5 rows at most (speculative decoding)
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


def test_auto_is_xla_on_cpu_and_names_are_checked():
    if jax.default_backend() == "cpu":
        assert AttentionBackend.resolve("auto") == AttentionBackend("xla")
        for impl in ("pallas", "pallas_tpu", "pallas_gpu"):
            with pytest.raises(ValueError, match=f"attention_impl='{impl}' cannot run on cpu"):
                AttentionBackend.resolve(impl)
    assert AttentionBackend.resolve("pallas_tpu_interpret").name == "pallas_tpu_interpret"
    with pytest.raises(ValueError, match="attention_impl must be"):
        AttentionBackend.resolve("reference")


def test_the_backend_owns_the_pool_shape():
    config = ModelConfig("llama", 96, 64, 96, 3, 4, 2, 16, 1e-6, 1e4, 256)
    for name, head_dim in (("xla", 16), ("pallas_gpu_interpret", 16), ("pallas_tpu_interpret", 128)):
        backend = AttentionBackend(name)
        assert backend.pool_shape(config, num_pages=5, page_size=8) == (3, 5, 8, 2, head_dim)
        assert backend.kv_bytes_per_token(config, 4) == 2 * 3 * 2 * head_dim * 4
    assert config.kv_bytes_per_token(4) == 2 * 3 * 2 * 16 * 4  # the model's own formula: no padding


@pytest.mark.parametrize("name", ["pallas_tpu_interpret", "pallas_gpu_interpret"])
@pytest.mark.parametrize(
    ("seqs", "max_q_len"), [(DECODES, 1), (VERIFIES, 5), (MIXED, None)], ids=["decode-only", "verify", "mixed"]
)
def test_kernels_match_the_xla_backend(name, seqs, max_q_len):
    q, k, v, batch, kv_cache = step(seqs)

    attention = jax.jit(
        lambda backend, *args: PagedAttention(backend, 0.2, None, max_q_len)(*args, jnp.int32(0)),
        static_argnums=0,
    )
    if max_q_len == 1:
        q, k, v, batch = one_token_per_row(q, k, v, batch)
    want, want_cache = attention(AttentionBackend("xla"), q, k, v, batch, kv_cache)
    backend = AttentionBackend(name)
    head_dim = backend.pool_head_dim(GQA.head_dim)  # 128 for the TPU kernels: the engine allocates the pool padded
    padded = KVCache(k=pad_head_dim(kv_cache.k, head_dim), v=pad_head_dim(kv_cache.v, head_dim))
    got, got_cache = attention(backend, q, k, v, batch, padded)
    assert got_cache.k.shape[-1] == head_dim
    for got_pool, want_pool in ((got_cache.k, want_cache.k), (got_cache.v, want_cache.v)):
        np.testing.assert_array_equal(np.asarray(got_pool[..., : GQA.head_dim]), np.asarray(want_pool))
        assert (np.asarray(got_pool[..., GQA.head_dim :]) == 0).all()
    got, want = np.asarray(got), np.asarray(want)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-5)


def one_token_per_row(q, k, v, batch: PagedBatch):
    """The step cut to T == S tokens, the layout of a decode-only step (padding rows have no token)."""
    rows = batch.kv_lens.shape[0]
    batch = PagedBatch(batch.slot_mapping[:rows], batch.block_tables, batch.kv_lens, batch.cu_q_lens, batch.num_seqs)
    return q[:rows], k[:rows], v[:rows], batch


@pytest.mark.parametrize("seqs", [DECODES, [(1, 40)], [(1, 1), (1, 2)]])
def test_decode_only_and_mixed_give_the_same_attention(seqs):
    q, k, v, batch, kv_cache = step(seqs)
    q, k, v, batch = one_token_per_row(q, k, v, batch)
    outs = [
        jax.jit(lambda *a, d=d: PagedAttention(AttentionBackend("xla"), 0.2, None, d)(*a, jnp.int32(0)))(
            q, k, v, batch, kv_cache
        )
        for d in (None, 1)
    ]
    np.testing.assert_allclose(np.asarray(outs[0][0]), np.asarray(outs[1][0]), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(outs[0][1].k), np.asarray(outs[1][1].k))


def test_verify_and_mixed_give_the_same_attention():
    q, k, v, batch, kv_cache = step(VERIFIES)
    outs = [
        jax.jit(lambda *a, r=r: PagedAttention(AttentionBackend("xla"), 0.2, None, r)(*a, jnp.int32(0)))(
            q, k, v, batch, kv_cache
        )
        for r in (None, 5)
    ]
    assert np.isfinite(np.asarray(outs[1][0])).all()
    np.testing.assert_allclose(np.asarray(outs[0][0]), np.asarray(outs[1][0]), atol=1e-6)
