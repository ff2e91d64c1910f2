"""Speculative decoding end to end on tiny random models, n-gram lookup and draft models: greedy output is token for
token the output without speculation (through chunked prefill, preemption, prefix caching, n > 1, stops and
max_tokens in the middle of a draft), with the same logprobs; sampled tokens keep plain sampling's distribution
(with n-gram drafts, they are plain sampling's tokens for the same seed, whatever the batch); rejected drafts leave
no trace in the page pool. Draft models: tests/test_spec_decode_draft_model.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats

from jaxpage.entrypoints.llm import LLM
from jaxpage.sampling_params import SamplingParams
from jaxpage.sequence import SequenceStatus

TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, rope_theta=10000.0, eos_token_id=2, tie_word_embeddings=False,
)  # fmt: skip
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def write_model(directory, **overrides) -> str:
    """A config.json only: load_format="dummy" makes the same random weights for every engine."""
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA | overrides))
    return str(directory)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


def make_llm(model_dir, speculative_config=None, always_verify=True, **engine_args) -> LLM:
    """always_verify: every step that has drafts verifies them (the speculation policy, which weighs measured step
    times on this machine, is tested on its own)."""
    args = dict(load_format="dummy", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, page_size=4)
    llm = LLM(model_dir, skip_tokenizer_init=True, speculative_config=speculative_config, **args | engine_args)
    if always_verify and speculative_config is not None:
        llm.engine.spec_decoder.policy.should_verify = lambda num_seqs, drafts, *shapes: bool(drafts)
    return llm


def prompts(count: int, seed: int = 0) -> list[dict]:
    """Prompts that repeat themselves (so that n-gram lookup finds drafts) and random ones."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        if i % 2:
            period = rng.integers(3, 90, size=int(rng.integers(2, 6))).tolist()
            ids = (period * 20)[: int(rng.integers(4, 40))]
        else:
            ids = rng.integers(3, 90, size=int(rng.integers(1, 40))).tolist()
        out.append({"prompt_token_ids": ids})
    return out


def without_float_ties(llm: LLM, requests: list[dict], max_tokens: int) -> list[dict]:
    """The requests whose greedy output (up to max_tokens) never has two tokens within 1e-5 of the top log-prob:
    elsewhere float rounding, which differs between step shapes, may pick either (DESIGN.md: greedy outputs are
    the same whatever the batch, up to float ties)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    kept = []
    for request, output in zip(requests, llm.generate(requests, params), strict=True):
        top_two = [
            sorted((lp.logprob for lp in entry.values()), reverse=True)[:2] for entry in output.outputs[0].logprobs
        ]
        if all(first - second > 1e-5 for first, second in top_two):
            kept.append(request)
    assert len(kept) >= 0.75 * len(requests), "too many float ties: pick other prompts"
    return kept


def completions(outputs) -> list[list[tuple]]:
    return [[(tuple(c.token_ids), c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


ENGINES = {
    "roomy": dict(),
    # Chunks of 16 tokens and a pool of 24 pages of 4 tokens for 8 sequences: prefills are chunked and sequences
    # are preempted; no prefix caching.
    "tight": dict(num_pages=25, max_model_len=96, max_num_batched_tokens=16, enable_prefix_caching=False),
    "prefix-cache-tight": dict(num_pages=33, max_model_len=96, max_num_batched_tokens=24),
}


@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_output_is_the_same_with_and_without_speculation(model_dir, engine):
    plain = make_llm(model_dir, **ENGINES[engine])
    requests = without_float_ties(plain, prompts(24), 48)
    params = [
        SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True)
        for m in np.random.default_rng(1).integers(1, 48, size=len(requests))
    ]
    spec = make_llm(model_dir, NGRAM, **ENGINES[engine])
    want = completions(plain.generate(requests, params))
    got = completions(spec.generate(requests, params))
    assert got == want
    stats_ = spec.engine.spec_decoding_stats
    assert stats_.num_drafts > 20 and stats_.num_accepted_tokens > 20  # speculation happened, and paid
    spec.engine.block_manager.check_invariants()
    assert spec.engine.block_manager.num_used_pages == 0  # every page back: rejected slots included
    if engine == "tight":
        assert spec.engine.scheduler.num_preemptions > 0
    if engine == "prefix-cache-tight":
        assert spec.engine.scheduler.num_prefix_hit_tokens > 0


def test_stops_and_max_tokens_in_the_middle_of_a_draft(model_dir):
    """Stop token ids and max_tokens end a sequence at the same token with and without speculation, even when
    the verify step accepted draft tokens past it."""
    rng = np.random.default_rng(4)
    plain = make_llm(model_dir)
    requests = without_float_ties(plain, prompts(16, seed=3), 40)
    spec = make_llm(model_dir, NGRAM)
    # Stop on a token that the plain output holds part-way through.
    free = completions(plain.generate(requests, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
    params = []
    for request in free:
        tokens = request[0][0]
        stop = [tokens[int(rng.integers(1, len(tokens)))]] if len(tokens) > 2 else []
        params.append(SamplingParams(temperature=0, max_tokens=int(rng.integers(2, 40)), stop_token_ids=stop))
    want = completions(plain.generate(requests, params))
    got = completions(spec.generate(requests, params))
    assert got == want
    assert {c[0][1] for c in want} == {"stop", "length"}
    assert spec.engine.spec_decoding_stats.num_accepted_tokens > 0


def test_parallel_sampling_and_logprobs_with_speculation(model_dir):
    """n > 1 (greedy samples of one request share its prompt pages) and the logprobs of accepted draft tokens,
    as plain decoding gives them."""
    plain_llm = make_llm(model_dir)
    requests = without_float_ties(plain_llm, prompts(8, seed=5), 24)
    params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    plain = plain_llm.generate(requests, params)
    spec_llm = make_llm(model_dir, NGRAM)
    spec = spec_llm.generate(requests, params)
    assert completions(spec) == completions(plain)
    for got, want in zip(spec, plain, strict=True):
        for g, w in zip(got.outputs, want.outputs, strict=True):
            assert len(g.logprobs) == len(w.logprobs) == len(g.token_ids)
            for got_entry, want_entry in zip(g.logprobs, w.logprobs, strict=True):
                assert list(got_entry) == list(want_entry)  # the token, then the top 3 (ids and ranks)
                for token, logprob in got_entry.items():
                    assert logprob.rank == want_entry[token].rank
                    np.testing.assert_allclose(logprob.logprob, want_entry[token].logprob, atol=1e-4)
            np.testing.assert_allclose(g.cumulative_logprob, w.cumulative_logprob, atol=1e-3)
    assert spec_llm.engine.spec_decoding_stats.num_accepted_tokens > 0


def test_seeded_sampling_is_reproducible_whatever_the_batch(model_dir):
    """A seeded request's tokens depend on its seed, its logits and its position: alone or in a batch, with
    preemption or not."""
    requests = prompts(12, seed=6)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=20, ignore_eos=True) for i in range(12)]
    together = completions(make_llm(model_dir, NGRAM).generate(requests, params))
    tight = make_llm(model_dir, NGRAM, **ENGINES["tight"])
    assert completions(tight.generate(requests, params)) == together
    alone_llm = make_llm(model_dir, NGRAM)
    alone = [completions(alone_llm.generate([r], p))[0] for r, p in zip(requests[:4], params[:4], strict=True)]
    assert alone == together[:4]
    assert tight.engine.spec_decoding_stats.num_drafts > 0


def test_sampled_tokens_are_plain_samplings(tmp_path):
    """Seeded sampling gives the tokens that plain sampling with the same seeds gives (n-gram drafts are verified
    by a coupling of rejection sampling, see jaxpage.sample.rejection_sampler), and the joint distribution of the first
    three tokens matches that of plain sampling with other seeds, by a chi-square test of homogeneity over 2400
    requests each; temperature, top-k and top-p settings. The prompt holds every token, so that n-gram lookup
    always drafts: the second and third tokens of rows that verify come out of verification."""
    vocab = 4
    model = write_model(tmp_path, vocab_size=vocab, eos_token_id=None)
    prompt = {"prompt_token_ids": list(range(vocab)) * 3 + [0, 1]}
    args = dict(max_num_seqs=256, max_num_batched_tokens=4096, num_pages=2000)  # 256 requests in lockstep
    spec_llm, plain_llm = make_llm(model, NGRAM, **args), make_llm(model, **args)
    count = 2400
    for setting in (dict(temperature=1.0), dict(temperature=0.7, top_k=3), dict(temperature=1.3, top_p=0.8)):

        def tokens(llm, first_seed, setting=setting):
            params = [
                SamplingParams(seed=first_seed + i, max_tokens=3, ignore_eos=True, **setting) for i in range(count)
            ]
            return [c[0][0] for c in completions(llm.generate([prompt] * count, params))]

        drafts_before = spec_llm.engine.spec_decoding_stats.num_drafts
        spec = tokens(spec_llm, 0)
        # A step drafts only when no sequence prefills: about half the rows verify here.
        assert spec_llm.engine.spec_decoding_stats.num_drafts - drafts_before >= count // 3
        same_seeds = tokens(plain_llm, 0)
        assert np.mean([a != b for a, b in zip(spec, same_seeds, strict=True)]) < 0.01  # float rounding at most
        other_seeds = tokens(plain_llm, count)
        cells = sorted(set(spec) | set(other_seeds))
        table = np.array([[sample.count(cell) for cell in cells] for sample in (spec, other_seeds)])
        table = table[:, table.sum(axis=0) >= 10]  # chi-square needs cells that are not nearly empty
        p_value = stats.chi2_contingency(table).pvalue
        assert p_value > 1e-3, (setting, p_value)


def test_rejected_drafts_never_reach_the_prefix_cache(model_dir):
    """After a run with many rejected drafts, every page in the prefix cache holds the tokens its key says, and a
    new request with a cached prefix gets the same greedy output as without the cache."""
    spec = make_llm(model_dir, NGRAM)
    requests = without_float_ties(make_llm(model_dir), prompts(16, seed=8), 38)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outputs = spec.generate(requests, params)
    stats_ = spec.engine.spec_decoding_stats
    assert stats_.num_draft_tokens > stats_.num_accepted_tokens > 0  # some drafts were rejected
    # Every cached page's key matches the tokens of a finished sequence at that page.
    texts = {
        tuple(r["prompt_token_ids"]) + tuple(o.outputs[0].token_ids) for r, o in zip(requests, outputs, strict=True)
    }
    bm = spec.engine.block_manager
    cached = list(bm._page_key.values())
    assert cached
    for _, tokens in cached:
        assert any(tokens == text[i : i + len(tokens)] for text in texts for i in range(0, len(text), 4))
    # Requests that continue earlier outputs reuse their pages and decode as without the cache.
    follow = [
        {"prompt_token_ids": r["prompt_token_ids"] + list(o.outputs[0].token_ids)}
        for r, o in zip(requests, outputs, strict=True)
    ]
    before = spec.engine.scheduler.num_prefix_hit_tokens
    got = completions(spec.generate(follow, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    assert spec.engine.scheduler.num_prefix_hit_tokens > before
    uncached = make_llm(model_dir, NGRAM, enable_prefix_caching=False)
    assert got == completions(uncached.generate(follow, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))


def test_a_finished_sequence_has_no_draft_slots_left(model_dir):
    """During a run, after every step, each running sequence holds exactly the pages of its computed tokens
    plus nothing past them: the slots of rejected drafts went back."""
    llm = make_llm(model_dir, NGRAM)
    engine = llm.engine
    for i, request in enumerate(prompts(6, seed=9)):
        engine.add_request(str(i), request, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    page_size = engine.block_manager.page_size
    while engine.has_unfinished_requests():
        engine.step()
        engine.block_manager.check_invariants()
        for seq in engine.scheduler.running:
            assert seq.status is SequenceStatus.RUNNING
            assert len(seq.block_table) == -(-seq.num_computed_tokens // page_size)
            if seq.num_computed_tokens >= seq.num_prompt_tokens:  # decoding (not in the middle of its prompt)
                assert seq.num_tokens == seq.num_computed_tokens + 1
    assert engine.spec_decoding_stats.num_draft_tokens > engine.spec_decoding_stats.num_accepted_tokens


# ----- draft model -----


def test_stop_strings_and_mixed_greedy_and_sampled_rows(tiny_dir):
    """Stop strings reached inside an accepted draft end the text where plain decoding ends it; greedy and seeded
    sampled rows in one batch each give plain decoding's tokens."""
    args = dict(load_format="auto", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, page_size=4)
    plain = LLM(tiny_dir, **args)
    spec = LLM(tiny_dir, speculative_config=NGRAM, **args)
    spec.engine.spec_decoder.policy.should_verify = lambda num_seqs, drafts, *shapes: bool(drafts)
    requests = without_float_ties(plain, prompts(8, seed=11), 30)
    free = plain.generate(requests, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    params = []
    for i, output in enumerate(free):
        text = output.outputs[0].text
        if i % 2 or len(text) < 8:  # sampled rows between the greedy ones
            params.append(SamplingParams(temperature=0.9, top_k=20, seed=i, max_tokens=30, ignore_eos=True))
        else:  # a stop string that the greedy text holds part-way through
            stop = text[len(text) // 2 : len(text) // 2 + 3]
            params.append(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
    want = plain.generate(requests, params)
    got = spec.generate(requests, params)
    assert [(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in got] == [
        (o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in want
    ]
    assert completions(got) == completions(want)
    assert any(o.outputs[0].finish_reason == "stop" for o in want)
    assert spec.engine.spec_decoding_stats.num_accepted_tokens > 0
