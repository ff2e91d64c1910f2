"""The attention backend: chosen once from attention_impl; it owns the pool's shape, the K/V write and attending.
Every backend writes the same pool and gives the same attention as the XLA backend, for decode-only steps (the
decode kernels), verify steps (a few query rows per sequence, max_q_len) and mixed ones (the ragged kernels)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ragged_paged_attention import CASES, GQA, make_batch

from jaxpage.attention import AttentionBackend, PagedAttention, PagedBatch, resolve_backend
from jaxpage.attention.pallas_gpu import PallasGpuAttention
from jaxpage.attention.pallas_tpu import PallasTpuAttention
from jaxpage.attention.xla import XlaAttention, XlaTpuAttention
from jaxpage.config import ModelConfig
from jaxpage.kv_cache import KVCache
from pallas_kernels.impl import LANES, pad_head_dim, tpu_block_scales, tpu_pool_operands
from pallas_kernels.kv_quantization import dequantize, quantize

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
        assert resolve_backend("auto") == resolve_backend("xla")
        for impl in ("pallas", "pallas_tpu", "pallas_gpu"):
            with pytest.raises(ValueError, match=f"attention_impl='{impl}' cannot run on cpu"):
                resolve_backend(impl)
    for name, cls, interpret in (
        ("xla", XlaAttention, None),
        ("pallas_tpu_interpret", PallasTpuAttention, True),
        ("pallas_gpu_interpret", PallasGpuAttention, True),
    ):
        backend = resolve_backend(name)
        assert type(backend) is cls and getattr(backend, "interpret", None) == interpret and backend.name == name
    assert resolve_backend("pallas_tpu", platform="tpu") == PallasTpuAttention(platform="tpu")
    # Built for a TPU, the XLA backend keeps the pool in the TPU layout too (batch invariance's attention included).
    for options in ({}, {"batch_invariant": True}):
        backend = resolve_backend("xla", platform="tpu", **options)
        assert type(backend) is XlaTpuAttention and backend.tpu_layout and backend.name == "xla"
        assert isinstance(backend, XlaAttention) and backend.batch_invariant == bool(options)
    assert type(resolve_backend("xla", platform="gpu", batch_invariant=True)) is XlaAttention
    assert resolve_backend("xla", "fp8") == resolve_backend("xla", "fp8_e4m3")  # vLLM's fp8
    with pytest.raises(ValueError, match="attention_impl must be"):
        resolve_backend("reference")


# The backends compared with the XLA backend in its own layout: the kernels (in Pallas' interpreter), and the XLA
# backend as it is built for a TPU (XlaTpuAttention: the pool in the TPU layout; built here, it runs on this host),
# also in its batch-invariant form.
COMPARED = ["pallas_tpu_interpret", "pallas_gpu_interpret", "xla_built_for_tpu", "xla_batch_invariant_built_for_tpu"]


def compared_backend(name: str, kv_cache_dtype: str = "auto") -> AttentionBackend:
    if name.endswith("_built_for_tpu"):
        return resolve_backend("xla", kv_cache_dtype, platform="tpu", batch_invariant="batch_invariant" in name)
    return resolve_backend(name, kv_cache_dtype)


def backend_pool(backend: AttentionBackend, kv_cache: KVCache) -> KVCache:
    """kv_cache (the XLA backend's layout, head_dim already the backend's) in the backend's pool layout."""
    if not backend.tpu_layout:
        return kv_cache
    layers, num_pages = kv_cache.k.shape[:2]
    flat = (None if x is None else x.reshape(-1, *x.shape[2:]) for x in dataclasses.astuple(kv_cache))
    pools = tpu_pool_operands(tuple(flat), kv_cache.k.shape[-1])
    return KVCache(*(None if x is None else x.reshape(layers, num_pages, *x.shape[1:]) for x in pools))


def xla_pool(kv_cache: KVCache, num_kv_heads: int) -> KVCache:
    """A pool in the TPU layout back in the XLA backend's (the inverse of backend_pool)."""
    layers, num_pages, page_size, width = kv_cache.k.shape
    pages = (
        x.reshape(layers, num_pages, page_size, num_kv_heads, width // num_kv_heads) for x in (kv_cache.k, kv_cache.v)
    )

    scales = (kv_cache.k_scales, kv_cache.v_scales)  # [L, pages, rows, 128] -> [L, pages, page_size, kv_heads]
    return KVCache(*pages, *(None if x is None else tpu_block_scales(x, num_kv_heads, page_size) for x in scales))


def test_the_backend_owns_the_pool_layout():
    config = ModelConfig("llama", 96, 64, 96, 3, 4, 2, 16, 1e-6, 1e4, 256)
    pages = {"xla": (3, 5, 8, 2, 16), "pallas_gpu_interpret": (3, 5, 8, 2, 16), "pallas_tpu_interpret": (3, 5, 8, 256)}
    # The TPU layout: kv heads side by side (head_dim padded to 128); a page's 2 * 8 scales in a [2, 128] block.
    scales = {"xla": (3, 5, 8, 2), "pallas_gpu_interpret": (3, 5, 8, 2), "pallas_tpu_interpret": (3, 5, 2, LANES)}
    for name, head_dim in (("xla", 16), ("pallas_gpu_interpret", 16), ("pallas_tpu_interpret", 128)):
        backend = resolve_backend(name)
        layout = backend.pool_layout(config, num_pages=5, page_size=8, compute_dtype=jnp.bfloat16)
        assert layout.k.shape == layout.v.shape == pages[name] and layout.k.dtype == jnp.bfloat16
        assert layout.k_scales is None and layout.v_scales is None
        assert backend.kv_bytes_per_token(config, 4) == 2 * 3 * 2 * head_dim * 4
        assert backend.pool_specs().k_scales is None
        for kv_cache_dtype, dtype in (
            ("int8", jnp.int8),
            ("fp8_e4m3", jnp.float8_e4m3fn),
            ("fp8_e5m2", jnp.float8_e5m2),
        ):
            backend = resolve_backend(name, kv_cache_dtype)
            layout = backend.pool_layout(config, num_pages=5, page_size=8, compute_dtype=jnp.float32)
            assert layout.k.shape == pages[name] and layout.k.dtype == dtype
            assert layout.k_scales.shape == layout.v_scales.shape == scales[name]
            assert layout.k_scales.dtype == jnp.bfloat16
            specs = backend.pool_specs()
            assert len(specs.k) == len(pages[name]) and len(specs.k_scales) == len(scales[name])
            # what the sizing and the log use: every byte of the layout, per token
            pool_bytes = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(layout))
            assert backend.kv_bytes_per_token(config, 4, page_size=8) == pool_bytes // (5 * 8)
            scale_bytes = 2 * 128 * 2 // 8 if backend.tpu_layout else 2 * 2  # per token, a [2, 128] block a page
            assert pool_bytes // (5 * 8) == 2 * 3 * (2 * head_dim + scale_bytes)
    assert config.kv_bytes_per_token(4) == 2 * 3 * 2 * 16 * 4  # the model's own formula: no padding


@pytest.mark.parametrize("name", COMPARED)
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
    want, want_cache = attention(resolve_backend("xla"), q, k, v, batch, kv_cache)
    backend = compared_backend(name)
    head_dim = backend.pool_head_dim(GQA.head_dim)  # 128 for the TPU kernels: the engine allocates the pool padded
    padded = KVCache(k=pad_head_dim(kv_cache.k, head_dim), v=pad_head_dim(kv_cache.v, head_dim))
    got, got_cache = attention(backend, q, k, v, batch, backend_pool(backend, padded))
    got_cache = xla_pool(got_cache, GQA.num_kv_heads) if backend.tpu_layout else got_cache
    assert got_cache.k.shape[-1] == head_dim
    for got_pool, want_pool in ((got_cache.k, want_cache.k), (got_cache.v, want_cache.v)):
        np.testing.assert_array_equal(real_pages(got_pool)[..., : GQA.head_dim], real_pages(want_pool))
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
        jax.jit(lambda *a, d=d: PagedAttention(resolve_backend("xla"), 0.2, None, d)(*a, jnp.int32(0)))(
            q, k, v, batch, kv_cache
        )
        for d in (None, 1)
    ]
    np.testing.assert_allclose(np.asarray(outs[0][0]), np.asarray(outs[1][0]), atol=1e-6)
    np.testing.assert_array_equal(real_pages(outs[0][1].k), real_pages(outs[1][1].k))


def real_pages(pool) -> np.ndarray:
    """A pool [layers, pages, ...] without its null page (page 0): the step's padding tokens all write there, and on
    a GPU a scatter's writes to one slot land in any order (element by element), so its contents may differ."""
    return np.asarray(pool)[:, 1:]


def test_verify_and_mixed_give_the_same_attention():
    q, k, v, batch, kv_cache = step(VERIFIES)
    outs = [
        jax.jit(lambda *a, r=r: PagedAttention(resolve_backend("xla"), 0.2, None, r)(*a, jnp.int32(0)))(
            q, k, v, batch, kv_cache
        )
        for r in (None, 5)
    ]
    assert np.isfinite(np.asarray(outs[1][0])).all()
    np.testing.assert_allclose(np.asarray(outs[0][0]), np.asarray(outs[1][0]), atol=1e-6)


def quantized(kv_cache: KVCache, kv_cache_dtype: str, head_dim: int) -> KVCache:
    """kv_cache's pool (float, head_dim padded to `head_dim`) in 8 bits, as the engine would hold it."""
    dtype = resolve_backend("xla", kv_cache_dtype).pool_dtype(jnp.float32)
    (k, k_scales), (v, v_scales) = (quantize(pad_head_dim(x, head_dim), dtype) for x in (kv_cache.k, kv_cache.v))
    return KVCache(k=k, v=v, k_scales=k_scales, v_scales=v_scales)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_8_bit_pool_writes_quantized_tokens_and_attends_as_the_dequantized_pool(kv_cache_dtype):
    q, k, v, batch, kv_cache = step(MIXED)
    backend = resolve_backend("xla", kv_cache_dtype)
    attention = jax.jit(lambda backend, *a: PagedAttention(backend, 0.2)(*a, jnp.int32(0)), static_argnums=0)
    got, pool = attention(backend, q, k, v, batch, quantized(kv_cache, kv_cache_dtype, GQA.head_dim))
    assert pool.k.dtype == backend.pool_dtype(jnp.float32) and pool.k_scales.dtype == jnp.bfloat16
    # The step's tokens are in the pool, quantized per token and head: what quantize makes of them.
    slots = np.asarray(batch.slot_mapping)[: int(batch.cu_q_lens[int(batch.num_seqs)])]
    pages, offsets = slots // GQA.page_size, slots % GQA.page_size
    for new, pool_values, pool_scales in ((k, pool.k, pool.k_scales), (v, pool.v, pool.v_scales)):
        values, scales = quantize(new[: len(slots)], pool.k.dtype)
        np.testing.assert_array_equal(
            np.asarray(pool_values[0, pages, offsets], np.float32), np.asarray(values, np.float32)
        )
        np.testing.assert_array_equal(
            np.asarray(pool_scales[0, pages, offsets], np.float32), np.asarray(scales, np.float32)
        )
    # And attention reads that pool: the float backend on the same pool dequantized gives the same result.
    dequantized = KVCache(k=dequantize(pool.k, pool.k_scales), v=dequantize(pool.v, pool.v_scales))
    options = dict(sm_scale=0.2, sliding_window=None, max_q_len=None)
    want = resolve_backend("xla").attend(q, dequantized, batch, jnp.int32(0), **options)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


@pytest.mark.parametrize("name", COMPARED)
@pytest.mark.parametrize(("seqs", "max_q_len"), [(DECODES, 1), (MIXED, None)], ids=["decode-only", "mixed"])
def test_kernels_match_the_xla_backend_on_an_8_bit_pool(name, seqs, max_q_len):
    q, k, v, batch, kv_cache = step(seqs)
    if max_q_len == 1:
        q, k, v, batch = one_token_per_row(q, k, v, batch)
    attention = jax.jit(
        lambda backend, *args: PagedAttention(backend, 0.2, None, max_q_len)(*args, jnp.int32(0)), static_argnums=0
    )
    want, want_pool = attention(
        resolve_backend("xla", "int8"), q, k, v, batch, quantized(kv_cache, "int8", GQA.head_dim)
    )
    backend = compared_backend(name, "int8")
    head_dim = backend.pool_head_dim(GQA.head_dim)
    got, got_pool = attention(backend, q, k, v, batch, backend_pool(backend, quantized(kv_cache, "int8", head_dim)))
    got_pool = xla_pool(got_pool, GQA.num_kv_heads) if backend.tpu_layout else got_pool
    # The same pool wherever it holds tokens (stale slots hold NaN: what quantizing them gives is never read).
    live = ~np.isnan(np.asarray(kv_cache.k)).any(-1)  # [1, pages, page_size, kv_heads]
    np.testing.assert_array_equal(np.asarray(got_pool.k[..., : GQA.head_dim])[live], np.asarray(want_pool.k)[live])
    np.testing.assert_array_equal(np.asarray(got_pool.v_scales)[live], np.asarray(want_pool.v_scales)[live])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
