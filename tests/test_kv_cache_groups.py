"""A hybrid model's grouped pool (jaxpage.kv_cache.HybridKVCache, jaxpage.engine.kv_cache_groups): how the memory
budget is split between its groups, and the copies of each group's pages. (Scheduling over both groups:
tests/test_scheduler.py's HybridSchedulerMachine; the engine through them: tests/test_model_families.py.)"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpage.attention import XlaAttention
from jaxpage.config import EngineConfig, model_config_from_hf
from jaxpage.kv_cache import HybridKVCache, KVCache, copy_pool_pages, group_layer_index
from jaxpage.worker.kv_pool import copy_chunks
from jaxpage.worker.pool_sizing import engine_pool_pages, window_group_pages

# Gemma 3's pattern: five sliding layers, then a full one; 26 layers, window 512.
GEMMA3_SHAPED = model_config_from_hf(
    dict(
        model_type="gemma3_text", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, sliding_window=512, max_position_embeddings=32768,
    )
)  # fmt: skip


def test_gemma3s_pattern_groups_its_layers():
    assert sum(GEMMA3_SHAPED.sliding_layers) == 22  # layers 5, 11, 17, 23 see everything
    full, window = group_layer_index(GEMMA3_SHAPED.sliding_layers)
    assert [full[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3] and window[:7] == (0, 1, 2, 3, 4, 0, 5)


@pytest.mark.parametrize("budget_mib", [64, 2])
def test_the_budget_pays_for_the_window_group_first_and_gives_the_full_layers_the_rest(budget_mib):
    """64 MiB: the window group takes what max_num_seqs sequences' windows hold, the full layers every other byte
    (more pages than one pool of all 26 layers would have); 2 MiB, fewer pages than the windows would take: both
    groups get as many pages as one pool would."""
    budget = budget_mib << 20
    config = EngineConfig(
        model="unused", kv_cache_memory_bytes=budget, max_num_seqs=8, max_num_batched_tokens=256, page_size=16
    )
    layer_page_bytes = 2 * 16 * 64 * 4  # K and V of one layer's page: 16 tokens * 1 kv head * 64 dims * 4 bytes
    sized = (config, XlaAttention(), GEMMA3_SHAPED, GEMMA3_SHAPED, 4, None, None, 32768)
    num_pages, window_pages = engine_pool_pages(*sized)
    full_bytes, window_bytes = num_pages * 4 * layer_page_bytes, window_pages * 22 * layer_page_bytes
    one_pool = budget // (26 * layer_page_bytes)
    if budget_mib == 64:
        # 8 sequences * (the 511 keys before the next token: 33 pages, + 1 a step starts) + a step's 16 + the null one
        assert window_pages == window_group_pages(10**9, 512, 16, 8, 256) == 8 * (33 + 1) + 16 + 1
        assert full_bytes + window_bytes <= budget < full_bytes + window_bytes + 4 * layer_page_bytes
        assert num_pages > 1.4 * one_pool
    else:
        assert num_pages == window_pages == one_pool


def test_copies_go_to_each_groups_own_pages():
    """copy_chunks packs each group's copy-on-write copies in a row of its own; copy_pool_pages applies row g to
    group g only (page 3 of the window group is not page 3 of the full one)."""
    rng = np.random.default_rng(0)

    def group(layers):
        return KVCache(*(jnp.asarray(rng.standard_normal((layers, 6, 2, 1, 4)), jnp.float32) for _ in range(2)))

    pool = HybridKVCache(full=group(1), window=group(2))
    [(src, dst)] = copy_chunks([[(1, 2)], [(3, 4), (5, 1)]])
    assert src.shape == dst.shape == (2, 8) and src[0, :1].tolist() == [1] and src[1, :2].tolist() == [3, 5]
    copied = copy_pool_pages(pool, jnp.asarray(src), jnp.asarray(dst))
    want_full, want_window = np.array(pool.full.k), np.array(pool.window.k)
    want_full[:, 2] = want_full[:, 1]
    want_window[:, 4], want_window[:, 1] = want_window[:, 3], want_window[:, 5]
    np.testing.assert_array_equal(copied.full.k, want_full)
    np.testing.assert_array_equal(copied.window.k, want_window)
