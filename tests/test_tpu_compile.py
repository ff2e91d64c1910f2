"""The TPU kernels compiled the engine's way -- the stacked pool and a layer index, inside a jitted program whose
pool argument has XLA's default layout -- by the real TPU compiler for a compile-only TPU: the pool reaches the
kernels without a relayout copy, no temporary is as large as the pool, and the pool's compiled (tiled, padded)
bytes are what the backend's budget arithmetic says. Needs libtpu (`pip install 'jaxpage[tpu]'`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from jaxpage.attention import PagedBatch, resolve_backend
from jaxpage.benchmarks.hlo_copies import large_copies
from jaxpage.config import ModelConfig
from jaxpage.kv_cache import KVCache, copy_pages
from jaxpage.targets import TARGETS, available

TARGET = TARGETS["tpu-v5e"]
pytestmark = pytest.mark.skipif(
    not available(TARGET), reason="needs libtpu to compile for a TPU without one (pip install 'jaxpage[compile]')"
)

# 3 kv heads: with kv heads as a dimension of their own, the tiled layout would pad them to 4 (or 8).
CONFIG = ModelConfig("llama", 96, 64, 96, 2, 6, 3, 128, 1e-6, 1e4, 4096)
NUM_PAGES, PAGE_SIZE, SEQS, PAGES_PER_SEQ, TOKENS = 256, 16, 8, 16, 32


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("max_q_len", [1, None], ids=["decode", "ragged"])
def test_the_pool_is_read_in_place(kv_cache_dtype, max_q_len):
    backend = resolve_backend("pallas", kv_cache_dtype, platform="tpu")
    sharding = SingleDeviceSharding(TARGET.devices(1)[0])

    def placed(shape, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    layout = backend.pool_layout(CONFIG, NUM_PAGES, PAGE_SIZE, jnp.bfloat16)
    pool = jax.tree.map(lambda x: placed(x.shape, x.dtype), layout)
    tokens = SEQS if max_q_len == 1 else TOKENS
    q = placed((tokens, CONFIG.num_heads, CONFIG.head_dim), jnp.bfloat16)
    batch = PagedBatch(
        placed((tokens,)), placed((SEQS, PAGES_PER_SEQ)), placed((SEQS,)), placed((SEQS + 1,)), placed(())
    )

    def attend(q, pool, batch, layer):
        return backend.attend(q, pool, batch, layer, sm_scale=0.1, sliding_window=None, max_q_len=max_q_len)

    compiled = jax.jit(attend).lower(q, pool, batch, placed(())).compile()
    memory = compiled.memory_analysis()
    pool_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(layout))
    smallest = min(x.size * x.dtype.itemsize for x in jax.tree.leaves(layout))
    assert large_copies(compiled.as_text(), smallest) == []
    assert memory.temp_size_in_bytes < smallest
    budget = backend.kv_bytes_per_token(CONFIG, 2, page_size=PAGE_SIZE) * NUM_PAGES * PAGE_SIZE
    assert budget == pool_bytes
    assert budget <= memory.argument_size_in_bytes <= 1.02 * budget  # the rest: q and the step's metadata
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["flops"] >= 4 * tokens * CONFIG.num_heads * CONFIG.head_dim  # the kernel's estimate is counted


@pytest.mark.parametrize("tokens", [1, 64])
def test_the_step_s_writes_update_an_8_bit_pool_in_place(tokens):
    # The shape where a scatter of the scales' scalars got the whole scale arrays relaid out on every step (a
    # Llama-3-8B's 32 layers and 8 kv heads, a pool of 8192 pages, a decode step of <= 64 tokens), written the
    # way the model does: one layer after another in a loop. The scales are written as whole page blocks.
    config = dataclasses.replace(CONFIG, num_layers=32, num_kv_heads=8, num_heads=32)
    backend = resolve_backend("pallas", "int8", platform="tpu")
    sharding = SingleDeviceSharding(TARGET.devices(1)[0])
    layout = backend.pool_layout(config, 8192, PAGE_SIZE, jnp.bfloat16)
    pool = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), layout)
    k = jax.ShapeDtypeStruct((tokens, config.num_kv_heads, config.head_dim), jnp.bfloat16, sharding=sharding)
    slots = jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=sharding)

    def write_every_layer(pool, k, slots):
        return jax.lax.fori_loop(0, config.num_layers, lambda i, p: backend.write_kv(p, k, k, slots, i), pool)

    compiled = jax.jit(write_every_layer, donate_argnums=0).lower(pool, k, slots).compile()
    smallest = min(x.size * x.dtype.itemsize for x in jax.tree.leaves(layout))
    assert large_copies(compiled.as_text(), smallest) == []
    assert compiled.memory_analysis().temp_size_in_bytes < smallest


def test_page_copies_update_the_pool_in_place_on_v5p():
    # A Llama-3-8B pool's shape per page (32 layers, 8 kv heads x 128): there the v5p compiler split a gather of the
    # source pages into halves of the whole pool, each materialized (a temporary as large as the pool array).
    target = TARGETS["tpu-v5p"]
    sharding = SingleDeviceSharding(target.devices(1)[0])
    pages = jax.ShapeDtypeStruct((32, 1024, PAGE_SIZE, 8 * 128), jnp.bfloat16, sharding=sharding)
    ids = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=sharding)
    compiled = jax.jit(copy_pages, donate_argnums=0).lower(KVCache(pages, pages), ids, ids).compile()
    page_bytes = 32 * PAGE_SIZE * 8 * 128 * 2
    assert large_copies(compiled.as_text(), pages.size * 2) == []
    assert compiled.memory_analysis().temp_size_in_bytes <= 2 * 8 * page_bytes  # the copied pages, K and V
