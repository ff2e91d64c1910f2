"""The engine's behaviour on a tiny random model: stops, seeds, logprobs, errors, poisoned pages, compilations."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import TINY_ENGINE

from jaxpage.entrypoints.llm import LLM
from jaxpage.errors import ModelLoadError
from jaxpage.kv_cache import KVCache
from jaxpage.models import forward, load_model
from jaxpage.sampling_params import SamplingParams
from jaxpage.sequence import PROMPT_LOGPROB_TOKENS
from jaxpage.tokenizers.tokenizer import IncrementalDetokenizer, load_tokenizer
from jaxpage.worker.model_runner import MAX_LOGPROBS

PROMPTS = [[5, 9, 13, 2, 40], list(range(10, 60)), [77], [(7 * i) % 90 + 3 for i in range(23)]]


def make_llm(tiny_dir, **engine_args) -> LLM:
    args = TINY_ENGINE | engine_args
    return LLM(tiny_dir, **args)


def dense_greedy(tiny_dir, prompts: list[list[int]], num_tokens: int, process=None) -> list[list[int]]:
    """Greedy decoding with the cache-free forward pass (checked against transformers elsewhere), every prompt in
    one batch right-padded to the longest it will grow to: one shape, compiled once (causal attention keeps the
    padding after a row's tokens out of its logits). process(logits [V], row, output so far): what to take the
    argmax of instead of a row's logits."""
    config, params = load_model(tiny_dir)
    tokens = [list(p) for p in prompts]
    width = max(map(len, prompts)) + num_tokens
    for _ in range(num_tokens):
        ids = np.array([t + [0] * (width - len(t)) for t in tokens], np.int32)
        mask = np.array([[1] * len(t) + [0] * (width - len(t)) for t in tokens], np.int32)
        logits = np.asarray(forward(config, params, ids, attention_mask=mask))
        for row, (t, prompt) in enumerate(zip(tokens, prompts, strict=True)):
            row_logits = logits[row, len(t) - 1]
            if process is not None:
                row_logits = process(row_logits, row, t[len(prompt) :])
            t.append(int(row_logits.argmax()))
    return [t[len(p) :] for t, p in zip(tokens, prompts, strict=True)]


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="session")
def expected_greedy(tiny_dir):
    return dense_greedy(tiny_dir, PROMPTS, GREEDY.max_tokens)


def test_greedy_equals_the_dense_forward(tiny_dir, expected_greedy):
    outputs = make_llm(tiny_dir).generate(token_prompts(PROMPTS), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected_greedy


@pytest.mark.parametrize("attention_impl", ["pallas_tpu_interpret", "pallas_gpu_interpret"])
def test_pallas_kernels_give_the_same_greedy_outputs(tiny_dir, expected_greedy, attention_impl):
    # The engine with a Pallas kernel run in Pallas' interpreter, through one chunked prompt and decodes. The TPU
    # kernel reads pages of [page_size, kv_heads * head_dim], head_dim padded to 128; the GPU kernel's are
    # [page_size, kv_heads, head_dim].
    llm = make_llm(tiny_dir, attention_impl=attention_impl, max_num_batched_tokens=32)
    config = llm.engine.model_config
    pages = llm.engine.runner.kv_cache.k.shape[2:]
    if attention_impl == "pallas_tpu_interpret":
        assert pages == (llm.engine.config.page_size, config.num_kv_heads * 128)
    else:
        assert pages == (llm.engine.config.page_size, config.num_kv_heads, config.head_dim)
    outputs = llm.generate(token_prompts(PROMPTS), GREEDY)
    assert [out.outputs[0].token_ids for out in outputs] == expected_greedy


def test_a_pool_compiled_larger_than_its_shape_is_warned_of(tiny_dir):
    # The engine sizes the pool by its shape's bytes (the budget arithmetic); the fill program's compiled output is
    # the pool as the chip lays it out. Equal here (and on every TPU and GPU target compile_for builds); a chip
    # whose tiles padded it would make the budget undercount it, which the engine logs as a warning at start.
    runner = make_llm(tiny_dir).engine.runner
    shaped = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(runner.kv_cache))

    class Padded:
        def memory_analysis(self):
            return types.SimpleNamespace(output_size_in_bytes=int(1.05 * shaped))

    assert runner.pool.bytes_undercount(runner.pool.fill_program()) is None
    undercount = runner.pool.bytes_undercount(Padded())
    assert "5.0% more than the" in undercount and "undercounts" in undercount


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU-only refusal")
def test_a_kernel_that_cannot_run_here_is_refused_up_front(tiny_dir):
    with pytest.raises(ValueError, match="attention_impl='pallas' cannot run on cpu: there are no Pallas kernels"):
        make_llm(tiny_dir, attention_impl="pallas")


def greedy_with_poisoned_free_pages(llm: LLM) -> list[list[int]]:
    """PROMPTS' greedy tokens, every page no sequence holds (the null page included) poisoned before every step:
    NaN in every array of the pool (8-bit pages: NaN scales too)."""
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        held = {page for seq in engine.scheduler.running for page in seq.block_table}
        free = np.array([p for p in range(engine.block_manager.num_pages) if p not in held], np.int32)
        engine.runner.kv_cache = jax.tree.map(lambda x, free=free: x.at[:, free].set(jnp.nan), engine.runner.kv_cache)
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id)] = output.outputs[0].token_ids
    poisoned = engine.runner.kv_cache.k if engine.runner.kv_cache.k_scales is None else engine.runner.kv_cache.k_scales
    assert np.isnan(np.asarray(poisoned, np.float32)).any()  # the poison was really there
    return [finished[i] for i in range(len(PROMPTS))]


def test_poisoned_free_pages_change_no_output(tiny_dir, expected_greedy):
    llm = make_llm(tiny_dir, enable_prefix_caching=False, num_pages=40)
    assert greedy_with_poisoned_free_pages(llm) == expected_greedy


def test_no_compilation_after_warmup(tiny_dir):
    llm = make_llm(tiny_dir)
    runner = llm.engine.runner
    warmed = llm.engine.warmup()
    compiled = runner.num_compilations
    rows = {shape.sample_rows for shape in runner.shapes}
    # Samplers: plain, with masks and biases, with penalties; and the prompt log-probs program.
    assert compiled == len(runner.shapes) + 3 * len(rows) + 1
    assert [c.program for c in warmed].count("copy") == 1 and len(warmed) == compiled + 1
    assert sorted(c.shape for c in warmed if c.program == "forward") == sorted(runner.shapes)
    for sampler in ("sample", "sample+masks", "sample+penalties"):
        assert sorted(c.shape for c in warmed if c.program == sampler) == sorted(rows)
    assert llm.engine.warmup() == []  # nothing left to compile
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 96, rng.integers(1, 100)).tolist() for _ in range(20)]
    params = [
        SamplingParams(
            temperature=float(rng.uniform(0, 1.5)),
            top_p=0.9,
            max_tokens=int(rng.integers(1, 27)),
            logprobs=2 if i % 3 == 0 else None,
            ignore_eos=True,
            # Logits processors in some rows: a step runs the sampler variant its rows need, each warmed up.
            logit_bias={5: 3.0} if i % 4 == 1 else None,
            allowed_token_ids=list(range(10, 60)) if i % 5 == 2 else None,
            presence_penalty=0.5 if i % 7 == 3 else 0.0,
            prompt_logprobs=3 if i % 6 == 5 else None,
        )
        for i in range(20)
    ]
    outputs = llm.generate(token_prompts(prompts), params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert runner.num_compilations == compiled


def test_seeded_request_is_the_same_alone_and_in_a_batch(tiny_dir):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=1234, max_tokens=15, ignore_eos=True)
    alone = make_llm(tiny_dir).generate(token_prompts(PROMPTS[1:2]), seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=9, ignore_eos=True)
    crowd = make_llm(tiny_dir).generate(token_prompts(PROMPTS), [others, seeded, others, others])
    assert crowd[1].outputs[0].token_ids == alone
    unseeded = make_llm(tiny_dir).generate(token_prompts(PROMPTS[1:2]) * 2, others)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids  # distinct default seeds


def test_n_samples_of_one_prompt(tiny_dir, expected_greedy):
    [greedy] = make_llm(tiny_dir).generate(
        token_prompts(PROMPTS[:1]), SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True)
    )
    assert [c.index for c in greedy.outputs] == [0, 1, 2]
    assert all(c.token_ids == expected_greedy[0] for c in greedy.outputs)
    [sampled] = make_llm(tiny_dir).generate(
        token_prompts(PROMPTS[:1]), SamplingParams(n=3, seed=5, max_tokens=12, ignore_eos=True)
    )
    assert len({tuple(c.token_ids) for c in sampled.outputs}) == 3


def set_eos_token_ids(llm, ids) -> None:
    """The tokens that end a sequence, as the schedulers check them (Scheduler.update_from_output)."""
    for replica in llm.engine.replicas:
        replica.scheduler.config = dataclasses.replace(replica.scheduler.config, eos_token_ids=frozenset(ids))


def test_stop_token_ids_eos_and_max_tokens(tiny_dir, expected_greedy):
    llm = make_llm(tiny_dir)
    set_eos_token_ids(llm, ())  # random weights may emit the tiny model's EOS anywhere; set again below
    expected = expected_greedy[1]
    stop_at = next(i for i in range(3, len(expected)) if expected[i] not in expected[:i])  # a first occurrence
    token = expected[stop_at]
    out = llm.generate(
        token_prompts(PROMPTS[1:2]), SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[token])
    )
    completion = out[0].outputs[0]
    assert completion.token_ids == expected[: stop_at + 1]  # the stop token is kept in token_ids
    assert (completion.finish_reason, completion.stop_reason) == ("stop", token)

    set_eos_token_ids(llm, {token})
    out = llm.generate(token_prompts(PROMPTS[1:2]), SamplingParams(temperature=0, max_tokens=12))
    assert out[0].outputs[0].token_ids == expected[: stop_at + 1] and out[0].outputs[0].finish_reason == "stop"
    out = llm.generate(token_prompts(PROMPTS[1:2]), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected and out[0].outputs[0].finish_reason == "length"


def test_max_model_len_ends_a_request(tiny_dir):
    llm = make_llm(tiny_dir, max_model_len=56)
    [out] = llm.generate(token_prompts(PROMPTS[1:2]), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 56
    assert out.outputs[0].finish_reason == "length"


def test_stop_strings_are_cut_from_the_text(tiny_dir):
    llm = make_llm(tiny_dir)
    full = llm.generate(token_prompts(PROMPTS[3:4]), GREEDY)[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert len(stop) == 2 and stop.strip()
    cut = full[: full.find(stop)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop, "never appears 123"])
    completion = llm.generate(token_prompts(PROMPTS[3:4]), params)[0].outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == (cut, "stop", stop)
    streamed = [o.outputs[0].text for o in llm.generate_stream(token_prompts(PROMPTS[3:4]), params)]
    assert all(b.startswith(a) for a, b in zip(streamed, streamed[1:], strict=False))  # never takes text back
    assert streamed[-1] == cut


def test_streaming_yields_growing_outputs(tiny_dir):
    llm = make_llm(tiny_dir)
    outputs = list(llm.generate_stream(token_prompts(PROMPTS[:2]), GREEDY))
    for rid in {o.request_id for o in outputs}:
        mine = [o for o in outputs if o.request_id == rid]
        assert [len(o.outputs[0].token_ids) for o in mine] == list(range(1, 13))
        assert [o.finished for o in mine] == [False] * 11 + [True]
    assert llm.engine.block_manager.num_used_pages == 0


def test_logprobs_are_those_of_the_model(tiny_dir):
    llm = make_llm(tiny_dir)
    [out] = llm.generate(
        token_prompts(PROMPTS[:1]), SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    )
    completion = out.outputs[0]
    config, params = load_model(tiny_dir)
    tokens = PROMPTS[0] + completion.token_ids
    reference = np.asarray(jax.nn.log_softmax(forward(config, params, [tokens])[0]))
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = reference[len(PROMPTS[0]) - 1 + i]
        assert entry[token].logprob == pytest.approx(row[token], abs=1e-4)
        assert entry[token].rank == 1  # greedy picks the most likely token
        top = sorted(entry.values(), key=lambda lp: lp.rank)
        assert len(top) == 3
        np.testing.assert_allclose([lp.logprob for lp in top], np.sort(row)[::-1][:3], atol=1e-4)
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs, strict=True)), abs=1e-4
    )


def test_abort_returns_the_pages(tiny_dir):
    engine = make_llm(tiny_dir).engine
    engine.add_request("a", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
    engine.step()
    assert engine.block_manager.num_used_pages > 0
    engine.abort_request("a")
    assert not engine.has_unfinished_requests() and engine.block_manager.num_used_pages == 0


def test_step_stats_describe_each_step(tiny_dir):
    # PROMPTS[1] (50 tokens) takes two chunks; synchronous scheduling: each step's stats after its own step()
    engine = make_llm(tiny_dir, max_num_batched_tokens=32, async_scheduling=False).engine
    assert engine.last_step_stats is None
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(max_tokens=3, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        seen.append(engine.last_step_stats)
    first = seen[0]
    assert (first.num_seqs, first.num_tokens, first.num_decodes) == (2, 32, 0)  # 5 prompt tokens + 27 of 50
    # then a decode, the last 23 prompt tokens and the 1-token prompt; then decodes until each has 3 tokens
    assert [s.num_tokens for s in seen] == [32, 1 + 23 + 1, 3, 2]
    # Causal query-key pairs: a q-token chunk after c cached tokens has q * c + q (q + 1) / 2 of them.
    assert seen[0].num_attended_keys == 5 * 6 // 2 + 27 * 28 // 2
    assert seen[1].num_attended_keys == 6 + (23 * 27 + 23 * 24 // 2) + 1
    assert [s.num_sampled for s in seen] == [1, 3, 3, 2]
    assert all(s.num_decodes <= s.num_seqs for s in seen)
    for s in seen:
        assert min(s.schedule_s, s.prepare_s, s.device_s, s.postprocess_s) >= 0
        assert s.host_s == pytest.approx(s.schedule_s + s.prepare_s + s.postprocess_s)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", None, "prompt is empty"),
        ({"prompt_token_ids": []}, None, "non-empty list"),
        ({"prompt_token_ids": [1, 96]}, None, r"holds 96, not a token id in \[0, 96\)"),
        ({"prompt_token_ids": [1, -1]}, None, "holds -1"),
        ({"prompt_token_ids": list(range(3, 93)) * 2}, None, "prompt is 180 tokens; max_model_len 128"),
        (42, None, "prompt must be a string or a dict"),
    ],
)
def test_bad_requests_are_refused_and_the_rest_goes_on(tiny_dir, expected_greedy, prompt, params, message):
    llm = make_llm(tiny_dir)
    sampling = SamplingParams(**params) if params else None
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}, prompt], sampling)
    assert not llm.engine.has_unfinished_requests()  # nothing of the failed call stays queued
    assert llm.generate(token_prompts(PROMPTS[:1]), GREEDY)[0].outputs[0].token_ids == expected_greedy[0]


def test_a_pool_that_cannot_hold_max_model_len_is_refused_or_lowers_it(tiny_dir):
    # 7 usable pages of 8 tokens hold 56 tokens: an explicit max_model_len of 128 could never be served.
    with pytest.raises(ValueError, match="max_model_len 128 does not fit in the KV pool, which holds 56 tokens"):
        make_llm(tiny_dir, num_pages=8)
    # Left to the model's default (256), it is lowered to what the pool holds.
    llm = make_llm(tiny_dir, num_pages=8, max_model_len=None)
    assert llm.engine.max_model_len == 56
    [output] = llm.generate({"prompt_token_ids": [5]}, SamplingParams(max_tokens=127, ignore_eos=True))
    assert (len(output.outputs[0].token_ids), output.outputs[0].finish_reason) == (55, "length")
    assert llm.engine.block_manager.num_used_pages == 0


def test_an_explicit_pool_larger_than_memory_is_refused_before_allocating(tiny_dir):
    # 200 M pages of 8 tokens at 768 bytes per token: 1.2 TB.
    with pytest.raises(ValueError, match=r"KV pool of 200000000 pages .* does not fit in the \d+ bytes of memory"):
        make_llm(tiny_dir, num_pages=200_000_000)


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("top_k", -3),
        ("min_p", 2.0),
        ("n", 0),
        ("logprobs", 21),
        ("stop", [""]),
        ("seed", 1.5),
    ],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be"):
        SamplingParams(**{field: value})


def test_incremental_detokenizer_across_multibyte_characters(smollm2_path):
    tokenizer = load_tokenizer(smollm2_path)
    text = "Zoë said: 東京は晴れ 🙂🙃, naïve café — ok!"
    ids = tokenizer(text).input_ids
    detokenizer = IncrementalDetokenizer(tokenizer, [1, 2, 3], skip_special_tokens=True)
    deltas = [detokenizer.add(token) for token in ids]
    assert "".join(deltas) == detokenizer.text == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas.count("") > 0  # some tokens ended inside a character and were held back


# A start of the engine in a fresh process: one short greedy request; prints its tokens, the programs it compiled or
# loaded, and how many programs jax compiled (jax's log of compilations), as JSON.
START_AND_GENERATE = """
import json, logging, sys, jax
from jaxpage.entrypoints.llm import LLM
from jaxpage.sampling_params import SamplingParams
compiled = []
class Count(logging.Handler):
    def emit(self, record):
        compiled.extend(["x"] if record.getMessage().startswith("Finished XLA compilation") else [])
logging.getLogger("jax").addHandler(Count())
jax.config.update("jax_log_compiles", True)
llm = LLM(sys.argv[1], compilation_cache_dir=sys.argv[2], max_model_len=128, max_num_seqs=8,
          max_num_batched_tokens=64, page_size=8)
out = llm.generate([{"prompt_token_ids": [5, 9, 13]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
programs = [[c.program, c.loaded] for c in llm.engine.runner.compile_log]
print(json.dumps({"tokens": out[0].outputs[0].token_ids, "programs": programs, "xla_compilations": len(compiled)}))
"""


def test_a_second_start_with_the_compilation_cache_compiles_nothing(tiny_dir, tmp_path):
    def start() -> dict:
        cmd = [sys.executable, "-c", START_AND_GENERATE, tiny_dir, str(tmp_path / "cache")]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout.splitlines()[-1])

    first, second = start(), start()
    assert first["xla_compilations"] >= len(first["programs"]) >= 3  # pool, forward, sampler at least
    assert not any(loaded for _, loaded in first["programs"])
    assert second["xla_compilations"] == 0
    assert second["programs"] == [[program, True] for program, _ in first["programs"]]
    assert second["tokens"] == first["tokens"]


def test_compilation_cache_dir_that_cannot_be_made_is_refused(tiny_dir, tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="compilation_cache_dir: cannot create"):
        make_llm(tiny_dir, compilation_cache_dir=str(tmp_path / "a-file" / "cache"))


def test_dummy_weights_without_a_tokenizer(tiny_dir):
    # vLLM's load_format="dummy" and skip_tokenizer_init: the model's shapes with random weights, token ids only.
    llm = make_llm(tiny_dir, load_format="dummy", skip_tokenizer_init=True)
    assert llm.get_tokenizer() is None
    trained = load_model(tiny_dir)[1]
    dummy = llm.engine.runner.params
    assert jax.tree.structure(dummy) == jax.tree.structure(trained)
    assert all(a.shape == b.shape for a, b in zip(jax.tree.leaves(dummy), jax.tree.leaves(trained), strict=True))
    assert not np.array_equal(np.asarray(dummy["embed_tokens"]["embedding"]), trained["embed_tokens"]["embedding"])
    (out,) = llm.generate(token_prompts(PROMPTS[:1]), GREEDY)
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="text prompt needs the tokenizer"):
        llm.generate("hello", GREEDY)
    with pytest.raises(ValueError, match="stop strings need the tokenizer"):
        llm.generate(token_prompts(PROMPTS[:1]), SamplingParams(max_tokens=4, stop=["x"]))


def test_dummy_weights_need_a_config_json(smollm2_path):
    with pytest.raises(ModelLoadError, match="load_format='dummy' needs a Hugging Face model directory"):
        load_model(smollm2_path, load_format="dummy")


def test_the_full_logits_never_leave_the_step(tiny_dir):
    # Log-probs are computed inside the sampler program (the top MAX_LOGPROBS only): a step's programs return the
    # hidden rows the sampler needs, the pool, token ids and those log-probs; nothing as wide as the vocabulary.
    llm = make_llm(tiny_dir)
    runner = llm.engine.runner
    runner.warmup()
    hidden, pool = llm.engine.model_config.hidden_size, runner.kv_cache.k.shape
    for shape, program in runner.executables.items():
        rows = [(shape.sample_rows, hidden), (PROMPT_LOGPROB_TOKENS, hidden)]  # the sampler's, the prompt log-probs'
        assert [x.shape for x in jax.tree.leaves(program.out_info)] == [*rows, pool, pool]
    for (rows, k, _), program in runner.samplers.items():
        top = (rows, k + 1, MAX_LOGPROBS)  # k = 0: one token per row (k > 0: verifying k draft tokens)
        # ... and each row's last token, padded to the most rows a sampler has (read by the next step on the device)
        last = (runner.inputs.max_sample_rows,)
        assert [x.shape for x in jax.tree.leaves(program.out_info)] == [
            *((rows, k + 1), (rows,), (rows, k + 1), top, top),
            last,
        ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_float32_models_matmuls_are_float32(tiny_dir, dtype):
    # jax's default precision makes float32 matrix products TF32 on a GPU and one bfloat16 pass on a TPU; a float32
    # model asks for float32 ("highest") in every program it compiles. A bfloat16 model keeps the caller's setting
    # (here jax's default: the tests' conftest asks for "highest" everywhere else).
    with jax.default_matmul_precision("default"):
        llm = make_llm(tiny_dir, dtype=dtype)
        llm.generate(token_prompts(PROMPTS[:1]), SamplingParams(temperature=0, max_tokens=2))
    runner = llm.engine.runner
    programs = [*runner.executables.values(), *runner.samplers.values()]
    dots = [line for program in programs for line in program.as_text().splitlines() if " dot(" in line]
    assert dots and all(("operand_precision={highest,highest}" in dot) == (dtype == "float32") for dot in dots)


def test_page_copies_apply_as_if_all_at_once(tiny_dir):
    runner = make_llm(tiny_dir).engine.runner
    pool = np.random.default_rng(0).standard_normal(runner.kv_cache.k.shape).astype(np.float32)
    runner.kv_cache = KVCache(k=jnp.asarray(pool), v=jnp.asarray(-pool))
    # 11 copies: two calls of the one compiled size; then a cycle, whose destinations are also sources.
    for copies in ([(i + 1, i + 20) for i in range(11)], [(1, 2), (2, 3), (3, 1)]):
        before = np.asarray(runner.kv_cache.k)
        runner.copy_pages(copies)
        want = before.copy()
        for src, dst in copies:
            want[:, dst] = before[:, src]
        np.testing.assert_array_equal(np.asarray(runner.kv_cache.k), want)
        np.testing.assert_array_equal(np.asarray(runner.kv_cache.v), -want)
