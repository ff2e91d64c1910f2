"""LoRA adapters in the engine: requests pick adapters per request (LLM.generate's lora_request), steps mix them and
the base model, each request gets transformers + PEFT's greedy tokens for its adapter; adapters wait for a slot and
are swapped in and out of fewer slots than adapters; the prefix cache never gives one adapter's pages to another;
nothing compiles after warm-up; bad adapters and requests are refused by name while the engine keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import LORA_ADAPTERS as ADAPTERS
from hf_reference import hf_greedy_tokens
from tiny_models import TINY_ENGINE

from jaxpage.config import CacheConfig, EngineConfig
from jaxpage.entrypoints.llm import LLM
from jaxpage.errors import ModelLoadError
from jaxpage.lora_request import LoRARequest
from jaxpage.models.lora import slots_device_bytes
from jaxpage.sampling_params import SamplingParams
from jaxpage.worker.parallel import device_bytes
from jaxpage.worker.pool_sizing import kv_pool_pages

PROMPTS = [[5, 9, 13, 2, 40, 9, 9, 31], [77, 3, 64, 12, 12, 50], list(range(10, 30)), [33, 44, 55]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(lora_adapters):
    """Two slots for three adapters: some wait for a slot, and slots change adapters."""
    directory, _, _ = lora_adapters
    return LLM(str(directory), skip_tokenizer_init=True, enable_lora=True, max_loras=2, max_lora_rank=16, **TINY_ENGINE)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_a_batch_mixing_adapters_and_the_base_gives_each_peft_s_greedy_tokens(lora_adapters, llm, monkeypatch):
    _, hf, made = lora_adapters
    names = ["all-r8", None, "attention-r16", "mlp-r4-rslora", "all-r8", None, "mlp-r4-rslora", "attention-r16"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    fills = []
    fill = llm.engine.runner.lora.fill
    monkeypatch.setattr(llm.engine.runner.lora, "fill", lambda slot, weights: fills.append(slot) or fill(slot, weights))
    requests = [None if n is None else made[n][0] for n in names]
    got = tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=requests))
    base = hf_greedy_tokens(hf, prompts, GREEDY.max_tokens)
    for prompt, name, output, base_output in zip(prompts, names, got, base, strict=True):
        model = hf if name is None else made[name][1]
        assert output == hf_greedy_tokens(model, [prompt], GREEDY.max_tokens)[0], name
        assert (output == base_output) == (name is None), name  # each adapter changes the tokens
    assert len(fills) >= 3  # three adapters through two slots
    alone = [
        tokens(llm.generate({"prompt_token_ids": p}, GREEDY, lora_request=r))[0]
        for p, r in zip(prompts, requests, strict=True)
    ]
    assert alone == got
    assert llm.engine.block_manager.num_used_pages == 0
    assert llm.engine.scheduler.lora_slots.pins(1) == 0  # every pin given back


def test_the_prefix_cache_never_gives_one_adapter_s_pages_to_another(lora_adapters, llm):
    _, hf, made = lora_adapters
    prompt = {"prompt_token_ids": list(range(3, 60))}  # several full pages
    first = tokens(llm.generate(prompt, GREEDY, lora_request=made["all-r8"][0]))
    scheduler = llm.engine.scheduler
    hits = scheduler.num_prefix_hit_tokens
    other = tokens(llm.generate(prompt, GREEDY, lora_request=made["attention-r16"][0]))
    assert scheduler.num_prefix_hit_tokens == hits  # the same tokens under another adapter: recomputed
    assert other == hf_greedy_tokens(made["attention-r16"][1], [prompt["prompt_token_ids"]], GREEDY.max_tokens)
    assert tokens(llm.generate(prompt, GREEDY, lora_request=made["all-r8"][0])) == first
    assert scheduler.num_prefix_hit_tokens > hits  # the same adapter again: its pages are found


def test_bad_adapters_and_requests_are_refused_by_name_and_the_engine_keeps_serving(lora_adapters, llm, tmp_path):
    _, _, made = lora_adapters
    prompt = {"prompt_token_ids": PROMPTS[0]}
    assert tokens(llm.generate(prompt, GREEDY, lora_request=made["all-r8"][0]))  # id 1 is all-r8's from now on
    with pytest.raises(ModelLoadError, match=r"LoRA adapter 'missing' \(.*\): no such directory"):
        llm.generate(prompt, GREEDY, lora_request=LoRARequest("missing", 7, str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'all-r8'"):
        llm.generate(prompt, GREEDY, lora_request=LoRARequest("impostor", 1, str(tmp_path)))
    big = tmp_path / "big"
    big.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (big / name).write_bytes((Path(made["attention-r16"][0].lora_path) / name).read_bytes())
    settings = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps(settings | {"r": 32}))
    with pytest.raises(ModelLoadError, match="rank 32 is larger than max_lora_rank 16"):
        llm.generate(prompt, GREEDY, lora_request=LoRARequest("big", 8, str(big)))
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        llm.generate(prompt, GREEDY, lora_request=["all-r8"])
    with pytest.raises(ValueError, match="2 lora_requests for 1 prompts"):
        llm.generate([prompt], GREEDY, lora_request=[None, None])
    assert not llm.engine.has_unfinished_requests()
    assert tokens(llm.generate(prompt, GREEDY, lora_request=made["all-r8"][0]))  # still serving


def test_an_engine_without_lora_refuses_a_lora_request(lora_adapters):
    directory, _, made = lora_adapters
    plain = LLM(str(directory), skip_tokenizer_init=True, **TINY_ENGINE)
    with pytest.raises(ValueError, match="the engine serves no LoRA adapters; start it with enable_lora=True"):
        plain.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=made["all-r8"][0])


def test_nothing_compiles_after_warmup_whatever_the_adapters(lora_adapters, llm):
    _, _, made = lora_adapters
    llm.engine.warmup()
    compiled = len(llm.engine.runner.compile_log)
    requests = [made[n][0] for n in ADAPTERS] + [None]
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=requests)
    assert len(llm.engine.runner.compile_log) == compiled


@pytest.mark.parametrize(
    "layout",
    [dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
     dict(data_parallel_size=2), dict(async_scheduling=True), dict(tensor_parallel_size=6)],
    ids=["ngram-speculation", "data-parallel", "async-scheduling", "tensor-parallel"],
)  # fmt: skip
def test_speculation_replicas_and_async_steps_run_each_request_s_adapter(lora_adapters, layout):
    """Verify steps carry each token's slot (drafts checked under the request's adapter); data-parallel replicas
    share one set of slots; asynchronous scheduling fills a slot while the step before may still run; tensor
    parallelism splits the slots as their projections (6 shards: each of the 2 KV heads, and its adapters' B columns,
    copied to 3)."""
    directory, hf, made = lora_adapters
    llm = LLM(str(directory), skip_tokenizer_init=True, enable_lora=True, max_loras=2, **TINY_ENGINE, **layout)
    if "speculative_config" in layout:
        llm.engine.spec_decoder.policy.should_verify = lambda num_seqs, drafts, *shapes: bool(drafts)
    names = ["all-r8", "attention-r16", None, "mlp-r4-rslora"]
    prompts = [(p * 3)[:20] for p in PROMPTS]  # repetitive: n-gram drafts get accepted
    requests = [None if n is None else made[n][0] for n in names]
    got = tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=requests))
    for prompt, name, output in zip(prompts, names, got, strict=True):
        assert output == hf_greedy_tokens(hf if name is None else made[name][1], [prompt], GREEDY.max_tokens)[0]
    if "speculative_config" in layout:
        assert llm.engine.spec_decoding_stats.num_accepted_tokens > 0
    if "tensor_parallel_size" in layout:  # what each device holds of the slots is what the pool's budget left them
        runner = llm.engine.runner
        held = set(device_bytes(runner.params["lora"]).values())
        assert held == {slots_device_bytes(runner.config, 2, 16, 4, tensor_parallel_size=6)}


def test_the_device_s_budget_pays_for_the_lora_slots_beside_the_pool():
    cache = EngineConfig(page_size=16, gpu_memory_utilization=0.9, compilation_cache_dir=None).part(CacheConfig)
    limit, weights, page_bytes, slots = 16 << 30, 3 << 30, 16 * 4096, 700 << 20
    sizing = (cache, 4096, 4096, 1 << 20)
    plain = kv_pool_pages(*sizing, device_memory=(limit, weights))
    assert plain == (int(limit * 0.9) - weights) // page_bytes
    assert (
        kv_pool_pages(*sizing, device_memory=(limit, weights), unpooled_bytes=slots)
        == (int(limit * 0.9) - weights - slots) // page_bytes
    )
    # kv_cache_memory_bytes is the KV budget itself: the slots come beside it
    explicit = EngineConfig(page_size=16, kv_cache_memory_bytes=1 << 30, compilation_cache_dir=None).part(CacheConfig)
    assert kv_pool_pages(explicit, *sizing[1:], device_memory=(limit, weights), unpooled_bytes=slots) == (1 << 30) // (
        page_bytes
    )
    with pytest.raises(ValueError, match="and 734003200 bytes of LoRA slots does not fit"):
        kv_pool_pages(explicit, *sizing[1:], device_memory=(limit, limit - (1 << 30)), unpooled_bytes=slots)


def test_a_follower_process_replaying_the_leader_s_messages_fills_the_same_slots(lora_adapters):
    """Several processes: the leader sends each adapter's weights with its slot (a LORA message); a follower that
    replays its messages (jaxpage.worker.step_broadcast) without reading any adapter ends with the leader's slots and
    KV pool, bit for bit."""
    from test_multihost import Recorder, Replayer, attach

    directory, _, made = lora_adapters
    few_shapes = TINY_ENGINE | dict(max_num_seqs=4, max_num_batched_tokens=32)  # both warm up: every shape compiles
    leader, follower = (
        LLM(str(directory), skip_tokenizer_init=True, enable_lora=True, max_loras=2, tensor_parallel_size=2,
            **few_shapes)
        for _ in range(2)
    )  # fmt: skip
    recorder = Recorder()
    attach(leader.engine, recorder)
    leader.engine.warmup()
    requests = [made[n][0] for n in ADAPTERS] + [None]
    leader.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=requests)
    leader.engine.shutdown()
    attach(follower.engine, Replayer(recorder.sent))
    follower.engine.follow()
    ours, theirs = leader.engine.runner, follower.engine.runner
    assert [c.shape for c in ours.compile_log] == [c.shape for c in theirs.compile_log]
    slots = zip(jax.tree.leaves(ours.params["lora"]), jax.tree.leaves(theirs.params["lora"]), strict=True)
    for mine, replayed in slots:
        assert np.array_equal(mine, replayed) and np.any(mine)
    assert np.array_equal(ours.kv_cache.k, theirs.kv_cache.k) and np.array_equal(ours.kv_cache.v, theirs.kv_cache.v)


def test_host_memory_keeps_max_cpu_loras_adapters_and_reads_the_others_again(lora_adapters, monkeypatch):
    from jaxpage.engine import lora_adapters as module
    from jaxpage.models.hf_loader import read_hf_config

    directory, _, made = lora_adapters
    reads = []
    read = module.read_lora_adapter
    monkeypatch.setattr(module, "read_lora_adapter", lambda path, *args: reads.append(path) or read(path, *args))
    adapters = module.LoRAAdapters(read_hf_config(directory), 16, True, max_cpu_loras=2)
    requests = [made[name][0] for name in ADAPTERS]
    digests = [adapters.get(r)[1] for r in requests]
    assert adapters.num_read == 2 and len(reads) == 3
    assert adapters.get(requests[2])[1] == digests[2] and len(reads) == 3  # still read
    assert adapters.get(requests[0])[1] == digests[0] and len(reads) == 4  # dropped, read again: the same digest
    assert adapters.fresh_id() == 4 and adapters.fresh_id() == 5  # ids no adapter had
    adapters.forget(requests[0].lora_int_id)
    assert adapters.num_read == 1
    with pytest.raises(ValueError, match="engine argument max_cpu_loras 1 must be >= max_loras 2"):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)
