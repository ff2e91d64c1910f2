"""Parallel sampling (SamplingParams.n > 1) end to end on a tiny random model: the prompt is computed once and its
pages are shared by the n samples (the partly filled last one copied on write), and every sample is the one a
request with n = 1 and the same seed would give, through chunked prefill, preemption, prefix caching and aborts."""

from __future__ import annotations

import json

import pytest

from jaxpage.entrypoints.llm import LLM
from jaxpage.sampling_params import SamplingParams

TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, rope_theta=10000.0, eos_token_id=2, tie_word_embeddings=False,
)  # fmt: skip
PAGE_SIZE = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A config.json only: load_format="dummy" makes the same random weights for every engine."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(directory)


def make_llm(model_dir, **engine_args) -> LLM:
    # Synchronous scheduling on every platform: the tests count the steps and what each one scheduled.
    args = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, page_size=PAGE_SIZE) | engine_args
    args["async_scheduling"] = False
    return LLM(model_dir, load_format="dummy", skip_tokenizer_init=True, **args)


@pytest.fixture(scope="module")
def llm(model_dir):
    """Room for everything: no chunking, no preemption, prefix caching on."""
    return make_llm(model_dir)


@pytest.fixture(scope="module")
def small_llm(model_dir):
    """Chunks of 16 tokens, 8 pages (64 tokens: one sequence of max_model_len), no prefix caching."""
    return make_llm(
        model_dir, max_model_len=64, num_pages=9, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False
    )


def prompt(seed: int, length: int) -> dict:
    return {"prompt_token_ids": [(seed * 37 + 11 * i) % 90 + 3 for i in range(length)]}


def sampled(n: int, seed: int | None = 7, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)


def run(llm: LLM, request: dict, params: SamplingParams, schedules: list | None = None):
    """Runs one request alone through engine.step(), checking the page invariants after each step. Returns its
    final output and the tokens computed over its steps; appends each step's SchedulerOutput to `schedules`."""
    engine = llm.engine
    scheduler = engine.scheduler
    schedule = scheduler.schedule
    outputs = []

    def recording_schedule(*args):
        output = schedule(*args)
        outputs.append(output)
        return output

    scheduler.schedule = recording_schedule
    try:
        engine.add_request("parallel", request, params)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out if out.finished else final
            engine.block_manager.check_invariants()
    finally:
        del scheduler.schedule
    assert final is not None and engine.block_manager.num_used_pages == 0  # after all finish, nothing referenced
    if schedules is not None:
        schedules.extend(outputs)
    return final, sum(output.num_batched_tokens for output in outputs)


def one_by_one(llm: LLM, request: dict, params: SamplingParams) -> list[list[int]]:
    """Sample i of `params` as its own request with n = 1 and seed params.seed + i."""
    singles = [sampled(1, params.seed + i, params.max_tokens) for i in range(params.n)]
    return [out.outputs[0].token_ids for out in llm.generate([request] * params.n, singles)]


def tokens(output) -> list[list[int]]:
    return [completion.token_ids for completion in output.outputs]


@pytest.mark.parametrize("length", [21, 17, 1], ids=["partial-last-page", "prompt-ends-on-a-page", "one-token"])
def test_the_prompt_is_computed_once(llm, length):
    request, params = prompt(length, length), sampled(4)
    output, computed = run(llm, request, params)
    # L - 1 prompt tokens once, then each sample's last prompt token and its outputs but the last
    assert computed == (length - 1) + 4 * params.max_tokens
    assert [len(t) for t in tokens(output)] == [params.max_tokens] * 4


def test_a_prompt_found_in_the_prefix_cache_then_forks(llm):
    request, params = prompt(10, 21), sampled(4)
    first, _ = run(llm, request, params)
    again, computed = run(llm, request, params)  # pages 0 and 1 are cached: the parent computes 4 tokens, not 20
    assert computed == (20 - 16) + 4 * params.max_tokens
    assert tokens(again) == tokens(first)


def test_n_equal_1_is_unchanged(llm):
    request, params = prompt(2, 21), sampled(1)
    schedules = []
    output, computed = run(llm, request, params, schedules)
    assert computed == 21 + params.max_tokens - 1
    # the whole prompt in the first step, which samples; then one step per token
    assert [(item.num_computed_tokens, item.num_new_tokens) for item in schedules[0].scheduled] == [(0, 21)]
    assert len(schedules) == params.max_tokens
    assert tokens(output) == one_by_one(llm, request, params)


@pytest.mark.parametrize("length", [21, 1])
def test_samples_equal_requests_of_one_with_the_next_seeds(llm, length):
    request, params = prompt(3, length), sampled(4)
    output, _ = run(llm, request, params)
    assert tokens(output) == one_by_one(llm, request, params)
    assert len({tuple(t) for t in tokens(output)}) == 4
    [greedy] = llm.generate(request, SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True))
    assert tokens(greedy) == [tokens(greedy)[0]] * 3


def test_pages_are_shared_and_the_partial_page_copied(llm):
    # 21 tokens in pages of 8: the 20 shared fill pages 0 and 1 and 4 slots of page 2.
    engine, bm = llm.engine, llm.engine.block_manager
    engine.add_request("pages", prompt(4, 21), sampled(4, max_tokens=3))
    schedules = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda *args: schedules.append(schedule(*args)) or schedules[-1]
    try:
        assert engine.step() == []  # the parent computes 20 tokens, samples nothing
        [prefill] = schedules[0].scheduled
        parent = prefill.seq
        assert (prefill.num_new_tokens, schedules[0].page_copies) == (20, [])
        first_tokens = engine.step()
        fork = schedules[1]
        seqs = [item.seq for item in fork.scheduled]
        assert seqs[0] is parent and len(seqs) == 4 and all(item.num_new_tokens == 1 for item in fork.scheduled)
        assert len(first_tokens[0].outputs) == 4 and all(len(c.token_ids) == 1 for c in first_tokens[0].outputs)
        shared = parent.block_table[:2]
        assert all(seq.block_table[:2] == shared for seq in seqs)
        assert [bm._ref_counts[page] for page in shared] == [4, 4]
        tails = [seq.block_table[2] for seq in seqs]
        assert len(set(tails)) == 4 and all(bm._ref_counts[page] == 1 for page in tails)
        assert fork.page_copies == [(tails[0], tail) for tail in tails[1:]]
        bm.check_invariants()
        while engine.has_unfinished_requests():
            engine.step()
            bm.check_invariants()
    finally:
        del engine.scheduler.schedule
    assert all(not copies for copies in (s.page_copies for s in schedules[2:]))  # decodes write their own pages
    assert bm.num_used_pages == 0


def test_chunked_prefill_of_the_shared_prompt(small_llm, llm):
    request, params = prompt(5, 40), sampled(3, max_tokens=1)
    schedules = []
    output, computed = run(small_llm, request, params, schedules)
    assert computed == 39 + 3
    assert [s.num_batched_tokens for s in schedules] == [16, 16, 7, 3]  # the parent's 39 in chunks, then the fork
    assert tokens(output) == one_by_one(llm, request, params)


def test_preemption_of_forked_samples(small_llm, llm):
    # Each sample grows to 56 tokens (7 pages) and the pool holds 8 pages, so the request is accepted (one sample's
    # pages must fit, not four: they share the prompt and need not run at once). The samples preempt each other,
    # come back by forking the prompt again or recomputing it, and still give the samples of requests of one.
    engine = small_llm.engine
    before = engine.scheduler.num_preemptions
    request, params = prompt(6, 20), sampled(4, max_tokens=36)
    output, _ = run(small_llm, request, params)
    assert engine.scheduler.num_preemptions > before
    assert tokens(output) == one_by_one(llm, request, params)


@pytest.mark.parametrize("steps", [0, 1, 3, 4], ids=["queued", "prefilling", "before-fork", "after-fork"])
def test_abort_before_and_after_the_fork(small_llm, llm, steps):
    # 40 tokens in chunks of 16: the parent computes the shared 39 in steps 1-3, the samples fork in step 4.
    engine, bm = small_llm.engine, small_llm.engine.block_manager
    engine.add_request("doomed", prompt(8, 40), sampled(3, max_tokens=4))
    for _ in range(steps):
        engine.step()
        bm.check_invariants()
    assert bm.num_used_pages > 0 or steps == 0
    engine.abort_request("doomed")
    [aborted] = engine.step()
    assert aborted.finished and {c.finish_reason for c in aborted.outputs} == {"abort"}
    assert not engine.has_unfinished_requests() and bm.num_used_pages == 0
    bm.check_invariants()
    request, params = prompt(9, 30), sampled(2)
    output, _ = run(small_llm, request, params)  # the engine serves on, unharmed
    assert tokens(output) == one_by_one(llm, request, params)
