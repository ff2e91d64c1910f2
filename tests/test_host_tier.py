"""The prefix cache's host tier end to end (engine argument kv_offload_bytes; issue 46): a multi-turn workload whose
prefixes do not fit the device pool, run with and without the tier: the same tokens, the returning turns' prefixes
copied back from host memory instead of recomputed. Through preemption, parallel sampling (n > 1), data-parallel
replicas, a hybrid model's grouped pool and a draft model's pool. The bookkeeping's state machine over both tiers:
tests/test_block_manager.py; the copies against numpy: tests/test_host_kv_pool.py."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import TINY_FAMILIES

from jaxpage.config import EngineConfig
from jaxpage.entrypoints.cli import CommandError, _parser, engine_args
from jaxpage.entrypoints.llm import LLM
from jaxpage.entrypoints.metrics import EngineCounts, engine_gauges
from jaxpage.sampling_params import SamplingParams

GQA = next(f for f in TINY_FAMILIES if f.name == "llama3-gqa-rope-scaling")
GEMMA3 = next(f for f in TINY_FAMILIES if f.name == "gemma3-qk-norm-local-rope")
# A pool of 40 pages of 8 (312 tokens): a quarter of the workload's six 64-token prefixes and a request's turn at a
# time, with 4 rows: decoding requests run out of pages and are preempted.
SMALL_POOL = dict(num_pages=40, page_size=8, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)
HOST_BYTES = 1 << 20  # every prefix's pages, for these tiny models
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def turns(num_prefixes: int = 6, num_turns: int = 3, length: int = 64, seed: int = 0) -> list[list[list[int]]]:
    """Each turn's prompts: every conversation's prefix and a new message (of 3, 4, ... tokens) after it."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(1, 90, length).tolist() for _ in range(num_prefixes)]
    return [[p + rng.integers(1, 90, 3 + t).tolist() for p in prefixes] for t in range(num_turns)]


def run_turns(llm: LLM, workload, params, per_call: int = 2) -> list[list[list[int]]]:
    """Each request's samples' tokens, the turns sent in order, per_call requests at a time."""
    tokens = []
    for prompts in workload:
        for i in range(0, len(prompts), per_call):
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[i : i + per_call]], params)
            tokens += [[c.token_ids for c in o.outputs] for o in outputs]
    return tokens


def engines(path, **args) -> tuple[LLM, LLM]:
    common = dict(skip_tokenizer_init=True) | args
    return LLM(str(path), **common), LLM(str(path), kv_offload_bytes=HOST_BYTES, **common)


def host_loads(llm: LLM) -> int:
    return sum(bm.host.num_loaded_pages for r in llm.engine.replicas for bm in _groups(r.block_manager))


def _groups(block_manager):
    return getattr(block_manager, "groups", (block_manager,))


def test_returning_turns_load_their_prefixes_from_host_memory_and_sample_the_same_tokens(tiny_model_path):
    # Scheduled asynchronously: a step's copies are launched while the step before it runs on the device.
    without, with_tier = engines(tiny_model_path(GQA), async_scheduling=True, **SMALL_POOL)
    workload = turns()
    greedy = [run_turns(llm, workload, GREEDY, per_call=4) for llm in (without, with_tier)]
    assert greedy[0] == greedy[1]
    # Parallel sampling (seeded): the prompt's pages shared by the samples, forked, copied on write.
    sampled = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    samples = [run_turns(llm, workload[1:], sampled, per_call=3) for llm in (without, with_tier)]
    assert samples[0] == samples[1]
    engine, bm = with_tier.engine, with_tier.engine.block_manager
    assert engine.async_scheduling
    assert without.engine.block_manager.host is None and bm.host.num_slots == HOST_BYTES // bm_page_bytes(with_tier)
    assert engine.scheduler.num_preemptions > 0 and without.engine.scheduler.num_preemptions > 0
    # Without the tier a returning turn finds (nearly) nothing: its prefix was evicted by the five others.
    hits = [llm.engine.scheduler.num_prefix_hit_tokens for llm in (without, with_tier)]
    assert bm.host.num_loaded_pages >= 2 * 6 * 7 and hits[1] >= hits[0] + bm.host.num_loaded_pages * 8
    moved = engine.runner.pool.host.bytes_moved
    assert moved["load"] == bm.host.num_loaded_pages * bm_page_bytes(with_tier)
    assert moved["offload"] == bm.host.num_offloaded_pages * bm_page_bytes(with_tier)
    bm.check_invariants()
    assert bm.num_used_pages == 0
    # /metrics: the tier's hits, pages and bytes each way, the share of its slots in use; nothing without a tier.
    samples = scrape(with_tier)
    assert samples["jaxpage:kv_offload_hit_tokens_total", ()] == bm.host.num_loaded_pages * 8
    for direction, pages in (("offload", bm.host.num_offloaded_pages), ("load", bm.host.num_loaded_pages)):
        assert samples["jaxpage:kv_offload_pages_total", (("direction", direction),)] == pages
        assert samples["jaxpage:kv_offload_bytes_total", (("direction", direction),)] == moved[direction]
    assert samples["jaxpage:kv_offload_usage", ()] == bm.host.num_used_slots / bm.host.num_slots > 0
    plain = scrape(without)
    assert not any("kv_offload" in name for name, _ in plain) and ("jaxpage:prefix_cache_hits_total", ()) in plain


def scrape(llm: LLM) -> dict[tuple[str, tuple], float]:
    """The engine's counts as /metrics gives them: {(sample name, labels): value}."""
    registry = CollectorRegistry()
    registry.register(EngineCounts(lambda: engine_gauges(llm.engine)))
    families = text_string_to_metric_families(generate_latest(registry).decode())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def bm_page_bytes(llm: LLM) -> int:
    return llm.engine.runner.pool.host.page_bytes[0]


def test_the_host_tier_is_checked_where_it_is_given(tiny_model_path):
    with pytest.raises(ValueError, match="kv_offload_bytes.*needs enable_prefix_caching"):
        EngineConfig(kv_offload_bytes=1 << 30, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_bytes must be an integer >= 0, got -1"):
        EngineConfig(kv_offload_bytes=-1)
    assert EngineConfig(kv_offload_bytes=0).kv_offload_bytes is None  # 0: none
    with pytest.raises(ValueError, match="kv_offload_bytes 100 holds no page of the host tier.*give at least"):
        LLM(str(tiny_model_path(GQA)), kv_offload_bytes=100, skip_tokenizer_init=True, **SMALL_POOL)
    # The command line takes it in GiB (vLLM's --kv-offloading-size is in GiB too).
    assert engine_args(_parser().parse_args(["serve", "--kv-offload-gib", "0.5"]))["kv_offload_bytes"] == 1 << 29
    for bad in ("-1", "nan", "lots"):
        with pytest.raises(CommandError, match=f"--kv-offload-gib: expected a size in GiB .*got '{bad}'"):
            _parser().parse_args(["serve", "--kv-offload-gib", bad])


@pytest.mark.skipif(len(__import__("jax").devices()) < 4, reason="needs 4 devices (the suite simulates 8)")
def test_data_parallel_replicas_and_tensor_parallel_shards_each_keep_their_own_host_slots(tiny_model_path):
    # 2 replicas x 2 shards: each replica's pages in its own slots, each shard's KV head in its own (the copies run on
    # each device's shard: tests/test_host_kv_pool.py).
    parallel = dict(data_parallel_size=2, tensor_parallel_size=2)
    without, with_tier = engines(tiny_model_path(GQA), **parallel, **SMALL_POOL)
    workload = turns(num_prefixes=12, num_turns=2)
    assert run_turns(without, workload, GREEDY, 4) == run_turns(with_tier, workload, GREEDY, 4)
    assert all(r.block_manager.host.num_loaded_pages > 0 for r in with_tier.engine.replicas)


def test_a_hybrid_models_groups_each_keep_their_pages_on_the_host_by_their_own_rules(tiny_model_path):
    # Gemma 3's grouped pool: the window group's pages go back while a request runs (outside its window) and are
    # offloaded when evicted like the full group's; a hit is the prefix both groups hold, on either tier. 8-bit pages:
    # their scales go to host memory and back with them.
    without, with_tier = engines(tiny_model_path(GEMMA3), kv_cache_dtype="int8", **SMALL_POOL)
    workload = turns(num_turns=2)
    assert run_turns(without, workload, GREEDY) == run_turns(with_tier, workload, GREEDY)
    full, window = with_tier.engine.block_manager.groups
    assert full.host.num_loaded_pages > 0 and window.host.num_loaded_pages > 0
    host = with_tier.engine.runner.pool.host
    assert host.num_slots == (full.host.num_slots, window.host.num_slots)
    assert all(group.k_scales is not None and group.k.dtype == "int8" for group in host.cache)
    with_tier.engine.block_manager.check_invariants()


def test_a_draft_model_recomputes_what_a_host_hit_gives_the_target(tiny_model_path):
    # The target as its own draft: each draft token is the target's own greedy token, all accepted, as long as the
    # draft model's pool holds the same K/V as the target's. It has no host slots: a prefix hit's pages (from either
    # tier) are the target's, and the draft model catches up on them itself (DraftModelRunner.catch_up).
    path = str(tiny_model_path(GQA))
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    without, with_tier = engines(path, speculative_config=spec, **SMALL_POOL)
    workload = turns(num_turns=2)
    assert run_turns(without, workload, GREEDY) == run_turns(with_tier, workload, GREEDY)
    stats = with_tier.engine.spec_decoding_stats
    assert stats.num_drafts > 10 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert host_loads(with_tier) > 0 and with_tier.engine.draft_runner.pool.host is None
