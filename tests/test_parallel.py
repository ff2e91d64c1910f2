"""Tensor and data parallelism on 8 simulated CPU devices (conftest sets XLA's device count): greedy outputs
token-identical to one device, parameters and pages really split, KV heads copied where there are fewer than shards,
each replica its own pages, requests routed by prefix and load, clear errors, and nothing compiled after warm-up."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tiny_models import TinyFamily, write_tiny_model

from jaxpage.benchmarks.hlo_collectives import KINDS, executed
from jaxpage.entrypoints.llm import LLM
from jaxpage.sampling_params import SamplingParams
from jaxpage.worker import parallel

ARGS = dict(
    skip_tokenizer_init=True, max_model_len=96, max_num_seqs=4, page_size=4, max_num_batched_tokens=32, num_pages=96
)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def family(kv_heads: int, **kwargs) -> TinyFamily:
    """Eight query heads (vocabulary 96, intermediate 96: TP up to 8 divides them all)."""
    return TinyFamily(
        f"tp-kv{kv_heads}", "LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=kv_heads) | kwargs
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    made: dict = {}

    def get(kv_heads: int, **kwargs) -> str:
        fam = family(kv_heads, **kwargs)
        key = (kv_heads, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = str(write_tiny_model(fam, tmp_path_factory.mktemp(fam.name)))
        return made[key]

    return get


def executed_counts(all_reduce: int = 0, all_gather: int = 0) -> dict[str, int]:
    return dict.fromkeys(KINDS, 0) | {"all-reduce": all_reduce, "all-gather": all_gather}


def prompts(n: int = 5) -> list[dict]:
    return [{"prompt_token_ids": [(5 * i + j) % 90 + 3 for j in range(4 + 7 * i)]} for i in range(n)]


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY)]


def test_simulated_devices():
    assert len(jax.devices()) == 8  # tests/conftest.py


# Tied embeddings with 1 KV head over 8 shards (the LM head is the vocabulary-split embedding; the KV head copied to
# every shard); biases (q/k/v/o and MLP) with 2 KV heads over 4 shards (each copied to 2); 8 KV heads over 2 shards
# (4 on each) and over 8 (1 on each).
@pytest.mark.parametrize(
    ("kv_heads", "extra", "tp_sizes"),
    [(1, dict(tie_word_embeddings=True), (8,)), (2, dict(attention_bias=True, mlp_bias=True), (4,)), (8, {}, (2, 8))],
    ids=["kv1-tied", "kv2-biases", "kv8"],
)
def test_greedy_tokens_equal_one_device(model_dir, kv_heads, extra, tp_sizes):
    directory = model_dir(kv_heads, **extra)
    want = greedy(LLM(directory, **ARGS))
    for tp in tp_sizes:
        # Scheduled asynchronously: each step reads the step before's tokens from the devices of the mesh.
        llm = LLM(directory, **ARGS, tensor_parallel_size=tp, async_scheduling=True)
        assert greedy(llm) == want, f"tensor_parallel_size {tp}"
        pool = llm.engine.runner.kv_cache.k
        assert pool.shape[3] == max(kv_heads, tp)  # KV heads copied to every shard that reads them
        assert pool.sharding.is_equivalent_to(NamedSharding(llm.engine.mesh, parallel.POOL_SPEC), pool.ndim)


@pytest.mark.parametrize("attention_impl", ["pallas_gpu_interpret", "pallas_tpu_interpret"])
def test_pallas_kernels_under_shard_map(model_dir, attention_impl):
    """The kernels run per shard on its heads (in Pallas' interpreters here) and give the one-device tokens."""
    directory = model_dir(2)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    few = prompts(2)
    want = [o.outputs[0].token_ids for o in LLM(directory, **ARGS).generate(few, params)]
    llm = LLM(directory, **ARGS, tensor_parallel_size=2, attention_impl=attention_impl)
    assert [o.outputs[0].token_ids for o in llm.generate(few, params)] == want


def split_and_whole(params) -> tuple[int, int]:
    """(bytes of the parameters split over the shards, bytes of those every device holds whole)."""
    specs = jax.tree.leaves(parallel.param_specs(params), is_leaf=lambda x: isinstance(x, P))
    sizes = [leaf.nbytes for leaf in jax.tree.leaves(params)]
    split = sum(size for size, spec in zip(sizes, specs, strict=True) if any(spec))
    return split, sum(sizes) - split


@pytest.mark.parametrize(("kv_heads", "tp"), [(8, 4), (2, 8)])
def test_parameters_and_pages_are_split(model_dir, kv_heads, tp):
    llm = LLM(model_dir(kv_heads, attention_bias=True), **ARGS, tensor_parallel_size=tp)
    runner = llm.engine.runner
    held = parallel.device_bytes(runner.params)
    assert sorted(d.id for d in held) == list(range(tp))
    split, whole = split_and_whole(runner.params)
    assert whole < split / 10  # norms and o/down biases only
    assert set(held.values()) == {split // tp + whole}
    pool = parallel.device_bytes(runner.kv_cache)
    assert set(pool.values()) == {(runner.kv_cache.k.nbytes + runner.kv_cache.v.nbytes) // tp}
    # Each device holds one KV head's pages when the heads were copied (2 heads over 8 shards: 4 copies each).
    assert runner.kv_cache.k.addressable_shards[0].data.shape[3] == max(kv_heads, tp) // tp


def test_kv_head_copies_follow_the_query_heads(model_dir):
    """With fewer KV heads than shards, shard s holds a copy of the KV head that its query heads read."""
    directory = model_dir(2)
    one = LLM(directory, **ARGS)
    split = LLM(directory, **ARGS, tensor_parallel_size=8)
    k_one = np.asarray(one.engine.runner.params["layers"]["attn"]["k_proj"]["kernel"])  # [L, D, 2, d]
    k_split = np.asarray(split.engine.runner.params["layers"]["attn"]["k_proj"]["kernel"])  # [L, D, 8, d]
    queries_per_kv = 8 // 2
    for shard in range(8):  # shard s has query head s; it reads KV head s // 4
        np.testing.assert_array_equal(k_split[:, :, shard], k_one[:, :, shard // queries_per_kv])


@pytest.mark.parametrize(("tp", "dp"), [(4, 1), (2, 2)])
def test_nothing_compiles_after_warmup(model_dir, tp, dp):
    llm = LLM(model_dir(2), **ARGS, tensor_parallel_size=tp, data_parallel_size=dp)
    llm.engine.warmup()
    runner = llm.engine.runner
    compiled = runner.num_compilations
    # Megatron's communication, read from the compiled programs: two all-reduces per layer and one for the
    # embedding in every forward pass; the sampler's all-gather of the logits; nothing else.
    layers = llm.engine.model_config.num_layers
    for shape, forward in runner.executables.items():
        assert executed(forward.as_text()) == executed_counts(all_reduce=2 * layers + 1), shape
    for key, sampler in runner.samplers.items():
        assert executed(sampler.as_text()) == executed_counts(all_gather=1), key
    assert executed(runner.prompt_logprobs_program.as_text()) == executed_counts(all_gather=1)
    llm.generate(prompts(), GREEDY)
    llm.generate(prompts(3), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=5, seed=1))
    # Logits processors and prompt log-probs in some rows (at DP 2, in one replica's rows and not the other's: the
    # replicas' steps stack to the variant the step needs).
    controlled = SamplingParams(
        temperature=0, max_tokens=5, presence_penalty=1.0, logit_bias={3: 2.0}, prompt_logprobs=2
    )
    outputs = llm.generate(prompts(3), [controlled, GREEDY, SamplingParams(max_tokens=5, allowed_token_ids=[3, 4])])
    assert len(outputs[0].prompt_logprobs) == len(prompts(3)[0]["prompt_token_ids"])
    assert set(outputs[2].outputs[0].token_ids) <= {3, 4}
    assert runner.num_compilations == compiled


def test_sampling_matches_one_device(model_dir):
    """Seeded random sampling sees the whole vocabulary on every shard: the same tokens as one device; so do
    logits processors (penalties, biases, allowed tokens) and prompt log-probs."""
    directory = model_dir(8)
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=8, seed=3, logprobs=2)
    controlled = [
        SamplingParams(temperature=0, max_tokens=8, presence_penalty=1.0, logit_bias={3: 2.0}, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=list(range(3, 40)), repetition_penalty=1.2),
        SamplingParams(temperature=0, max_tokens=8),
    ]
    one = LLM(directory, **ARGS)
    want, want_controlled = one.generate(prompts(3), params), one.generate(prompts(3), controlled)
    llm = LLM(directory, **ARGS, tensor_parallel_size=4)
    got = llm.generate(prompts(3), params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.outputs[0].cumulative_logprob, w.outputs[0].cumulative_logprob, rtol=1e-4)
    got = llm.generate(prompts(3), controlled)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want_controlled]
    for position, (g, w) in enumerate(zip(got[0].prompt_logprobs, want_controlled[0].prompt_logprobs, strict=True)):
        assert (g is None) == (w is None) == (position == 0)
        if g is not None:
            assert g.keys() == w.keys()
            np.testing.assert_allclose([v.logprob for v in g.values()], [v.logprob for v in w.values()], atol=1e-4)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_under_tensor_parallelism(model_dir, method):
    """Verify steps (and a draft model's proposals, the target as its own draft, split like it) on the shards: the
    one-device greedy tokens, and the draft model's tokens all accepted."""
    directory = model_dir(2)
    spec = {"method": method, "num_speculative_tokens": 3}
    spec |= {"model": directory} if method == "draft_model" else {"prompt_lookup_min": 1, "prompt_lookup_max": 2}
    repetitive = [{"prompt_token_ids": ([7, 8, 9, 10] * 6)[: 12 + i]} for i in range(3)]
    want = [o.outputs[0].token_ids for o in LLM(directory, **ARGS).generate(repetitive, GREEDY)]
    llm = LLM(directory, **ARGS, tensor_parallel_size=2, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(repetitive, GREEDY)] == want
    stats = llm.engine.spec_decoding_stats
    assert stats.num_draft_tokens > 0
    if method == "draft_model":
        assert stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "message"),
    [
        (8, 2, 16, "tensor_parallel_size 16 needs 16 devices, but 8 cpu device"),
        (6, 2, 4, "does not divide the model's attention heads 6$"),
        (6, 3, 2, "does not divide the model's KV heads 3"),
    ],
    ids=["devices", "heads", "kv-heads"],
)
def test_layouts_that_do_not_divide_are_refused(tmp_path, heads, kv_heads, tp, message):
    config = dict(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=96)
    directory = write_tiny_model(TinyFamily("odd", "LlamaConfig", config), tmp_path)
    with pytest.raises(ValueError, match=message):
        LLM(str(directory), **ARGS, tensor_parallel_size=tp)


def test_the_engine_argument_is_checked():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(None, tensor_parallel_size=0)


@pytest.mark.parametrize(("tp", "dp"), [(1, 2), (2, 2), (2, 4)])
def test_data_parallel_replicas_give_one_devices_tokens(model_dir, tp, dp):
    directory = model_dir(2)
    many = prompts(9)
    want = [o.outputs[0].token_ids for o in LLM(directory, **ARGS).generate(many, GREEDY)]
    llm = LLM(directory, **ARGS, tensor_parallel_size=tp, data_parallel_size=dp)
    engine = llm.engine
    assert [o.outputs[0].token_ids for o in llm.generate(many, GREEDY)] == want
    # Each replica has its own range of the pool's pages, split over its TP shards by KV heads.
    pool = engine.runner.kv_cache.k
    assert pool.shape[1] == dp * engine.block_manager.num_pages
    assert pool.sharding.is_equivalent_to(NamedSharding(engine.mesh, parallel.POOL_SPEC), pool.ndim)
    assert set(parallel.device_bytes(engine.runner.kv_cache).values()) == {2 * pool.nbytes // (tp * dp)}
    assert len(engine.replicas) == dp
    assert all(r.block_manager.num_used_pages == 0 for r in engine.replicas)  # every page back


def test_requests_go_to_the_replica_with_their_prefix_else_the_least_loaded(model_dir):
    llm = LLM(model_dir(2), **ARGS | dict(max_num_seqs=8), data_parallel_size=2)
    engine = llm.engine
    shared = [(3 * j) % 90 + 3 for j in range(24)]  # six full pages of 4 tokens
    params = SamplingParams(temperature=0, max_tokens=2)
    first = engine.prepare_request("first", {"prompt_token_ids": shared + [5]}, params)
    engine.add_prepared_requests([first])
    while engine.has_unfinished_requests():
        engine.step()  # its pages stay in replica 0's prefix cache
    others = [engine.prepare_request(f"other-{i}", prompts(5)[i], params) for i in range(4)]
    again = engine.prepare_request("again", {"prompt_token_ids": shared + [6, 7]}, params)
    engine.add_prepared_requests(others + [again])
    assert first.replica == 0
    assert [r.replica for r in others] == [0, 1, 0, 1]  # least loaded, ties to the lowest index
    assert again.replica == 0  # its prefix is cached there, although replica 0 is not less loaded
    while engine.has_unfinished_requests():
        engine.step()
    hits = engine.replicas[0].scheduler.num_prefix_hit_tokens
    assert hits >= 20 and engine.replicas[1].scheduler.num_prefix_hit_tokens == 0


def test_speculative_decoding_is_refused_with_data_parallelism(model_dir):
    with pytest.raises(ValueError, match="speculative decoding runs without data parallelism"):
        LLM(
            model_dir(2),
            **ARGS,
            data_parallel_size=2,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )


# A Qwen2-MoE: 8 experts, top 2, a shared expert with its gate (vocabulary 96; every size divisible by 8).
MOE_FAMILY = TinyFamily(
    "tp-moe",
    "Qwen2MoeConfig",
    dict(
        num_attention_heads=8, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False,
    ),
)  # fmt: skip


def expert_bytes(llm: LLM) -> dict[int, int]:
    """Bytes of the routed experts' weights on each device."""
    return {d.id: b for d, b in parallel.device_bytes(llm.engine.runner.params["layers"]["mlp"]["experts"]).items()}


def test_mixture_of_experts_greedy_equals_one_device(tmp_path):
    """Tensor parallelism splits every expert by its features; expert parallelism (enable_expert_parallel) gives each
    of 2, 4 and 8 shards its E / tp experts whole: the same tokens as one device, each device 1 / tp of the experts'
    bytes."""
    directory = str(write_tiny_model(MOE_FAMILY, tmp_path))
    one = LLM(directory, **ARGS)
    want = greedy(one)
    total = sum(expert_bytes(one).values())
    for tp, expert_parallel in [(8, False), (2, True), (4, True), (8, True)]:
        llm = LLM(directory, **ARGS, tensor_parallel_size=tp, enable_expert_parallel=expert_parallel)
        assert greedy(llm) == want, f"tensor_parallel_size {tp}, enable_expert_parallel {expert_parallel}"
        assert expert_bytes(llm) == dict.fromkeys(range(tp), total // tp)
        experts = llm.engine.runner.params["layers"]["mlp"]["experts"]["gate_proj"]["kernel"]  # [L, E, D, F]
        assert experts.addressable_shards[0].data.shape[1:] == ((8 // tp, 64, 32) if expert_parallel else (8, 64, 4))
    with pytest.raises(ValueError, match="does not divide the model's .*number of experts 8"):
        LLM(directory, **ARGS, tensor_parallel_size=3, enable_expert_parallel=True)
