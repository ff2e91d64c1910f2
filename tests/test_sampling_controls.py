"""Penalties, logit_bias, allowed_token_ids, bad_words and min_tokens through the engine, against greedy decoding
with the cache-free forward pass and a numpy statement of vLLM's formulas (the device function itself is checked
formula by formula in tests/test_logits_processors.py)."""

from __future__ import annotations

import numpy as np
import pytest
from test_llm_api import dense_greedy
from tiny_models import TINY_ENGINE

from jaxpage.entrypoints.llm import LLM
from jaxpage.models import forward, load_model
from jaxpage.sampling_params import SamplingParams

PROMPTS = [[5, 9, 13, 2, 40, 9, 9], list(range(10, 40)), [77, 77, 3], [(7 * i) % 90 + 3 for i in range(23)]]
EOS = 2  # the tiny model's


def reference_logits(logits: np.ndarray, prompt: list[int], output: list[int], p: SamplingParams) -> np.ndarray:
    """vLLM's order and formulas, in numpy: allowed_token_ids and bad words (one-token ones; the tiny vocabulary
    spells no longer ones), min_tokens, logit_bias, then repetition, frequency and presence penalties."""
    logits = logits.astype(np.float32).copy()
    vocab = len(logits)
    if p.allowed_token_ids is not None:
        keep = np.zeros(vocab, bool)
        keep[p.allowed_token_ids] = True
        logits[~keep] = -np.inf
    if len(output) < p.min_tokens:
        logits[[EOS, *p.stop_token_ids]] = -np.inf
    for token, bias in (p.logit_bias or {}).items():
        logits[token] += np.float32(bias)
    counts = np.bincount(output, minlength=vocab)[:vocab]
    seen = (np.bincount(prompt, minlength=vocab)[:vocab] > 0) | (counts > 0)
    penalty = np.where(seen, np.float32(p.repetition_penalty), np.float32(1.0))
    logits = np.where(logits > 0, logits / penalty, logits * penalty)
    logits -= np.float32(p.frequency_penalty) * counts
    logits -= np.float32(p.presence_penalty) * (counts > 0)
    return logits


def reference_greedy(model_dir, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Greedy tokens of the cache-free forward pass under each request's controls (reference_logits)."""

    def process(logits, row, output):
        return reference_logits(logits, prompts[row], output, params[row])

    tokens = dense_greedy(model_dir, prompts, max(p.max_tokens for p in params), process)
    return [t[: p.max_tokens] for t, p in zip(tokens, params, strict=True)]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, **TINY_ENGINE)


CONTROLLED = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=1.5),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=2.0, repetition_penalty=1.3),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=0.5, logit_bias={17: 2.5}),
    SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=[2, 11, 23, 35, 47, 59], min_tokens=8),
]


def test_penalties_and_biases_match_vllm_formulas(llm, tiny_dir):
    """Each request with its own controls, in one batch (rows with and without penalties, a plain one too): the
    greedy tokens of the cache-free forward pass under the numpy formulas."""
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [PROMPTS[2], PROMPTS[1], PROMPTS[0], PROMPTS[3], PROMPTS[2]]
    params = [*CONTROLLED, plain]
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    expected = reference_greedy(tiny_dir, prompts, params)
    assert got == expected
    assert got[0] != got[4]  # the presence penalty changed prompt 2's output (plain, it repeats one token)
    assert set(got[3]) <= {2, 11, 23, 35, 47, 59} and 2 not in got[3][:8]


def test_min_tokens_holds_back_eos_and_stop_ids(llm):
    # The biased token is EOS / a stop id: it would end the output at once; min_tokens keeps it out until then.
    for params in (
        SamplingParams(temperature=0, max_tokens=20, logit_bias={EOS: 100}, min_tokens=6),
        SamplingParams(temperature=0, max_tokens=20, logit_bias={30: 100}, stop_token_ids=[30], min_tokens=4),
    ):
        completion = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params)[0].outputs[0]
        assert len(completion.token_ids) == params.min_tokens + 1 and completion.finish_reason == "stop"


def test_bad_words_are_never_generated(llm):
    """A one-token bad word is masked everywhere; a longer one only where its other tokens end the output."""
    engine = llm.engine
    tokenizer = engine.tokenizer
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = llm.generate([{"prompt_token_ids": PROMPTS[3]}], plain)[0].outputs[0].token_ids
    word = tokenizer.decode([free[0]])  # a token the tiny model picks first (ids < 96 spell single characters)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[word])
    banned = llm.generate([{"prompt_token_ids": PROMPTS[3]}], params)[0].outputs[0].token_ids
    assert free[0] not in banned and banned != free


def test_out_of_vocabulary_ids_are_refused_by_name(llm):
    engine = llm.engine
    for field, value in (("allowed_token_ids", [5, 500]), ("logit_bias", {500: 1.0})):
        with pytest.raises(ValueError, match=f"SamplingParams.{field} must be token ids in"):
            engine.add_request("x", {"prompt_token_ids": [5]}, SamplingParams(**{field: value}))
    assert not engine.has_unfinished_requests()
    for field, value, message in (
        ("presence_penalty", 2.5, r"in \[-2, 2\]"),
        ("frequency_penalty", -3, r"in \[-2, 2\]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("min_tokens", 20, "at most max_tokens"),
        ("logit_bias", {i: 1.0 for i in range(301)}, "at most 300"),
        ("allowed_token_ids", [], "non-empty"),
        ("prompt_logprobs", 21, r"in \[0, 20\]"),
    ):
        with pytest.raises(ValueError, match=f"SamplingParams.{field} must be .*{message}"):
            SamplingParams(**{field: value})
    assert SamplingParams(logit_bias={"7": 500, 8: -1e9}).logit_bias == {7: 100.0, 8: -100.0}  # clipped, ids as ints


def test_prompt_logprobs_equal_the_forward_pass(llm, tiny_dir):
    """vLLM's format (None for the first token, then the token's and the top k's log-probs and ranks), equal to
    the cache-free forward pass's log_softmax within 1e-4: for a prompt prefilled in chunks (100 tokens, 64 a
    step), one whose prefix another request left in the prefix cache, and a request with n = 2."""
    import jax

    rng = np.random.default_rng(0)
    long_prompt = rng.integers(3, 96, 100).tolist()
    cached_prefix = rng.integers(3, 96, 40).tolist()
    llm.generate([{"prompt_token_ids": cached_prefix + [7]}], SamplingParams(max_tokens=1))  # caches its pages
    prompts = [long_prompt, cached_prefix + [9, 10, 11], [5], [8, 9, 10, 11]]
    params = [SamplingParams(max_tokens=2, prompt_logprobs=k, n=n) for k, n in ((5, 1), (0, 1), (3, 1), (20, 2))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)

    config, weights = load_model(tiny_dir)
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        logprobs = np.asarray(jax.nn.log_softmax(forward(config, weights, np.array([prompt], np.int32))[0], axis=-1))
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for position in range(1, len(prompt)):
            expected = logprobs[position - 1]
            entry = out.prompt_logprobs[position]
            token = prompt[position]
            top = np.argsort(-expected, kind="stable")[: p.prompt_logprobs]
            assert set(entry) == {token, *top.tolist()}
            assert entry[token].rank == 1 + int((expected > expected[token]).sum())
            for tid, logprob in entry.items():
                assert abs(logprob.logprob - expected[tid]) < 1e-4, (position, tid)
            for rank, tid in enumerate(top, 1):
                assert entry[int(tid)].rank == rank or tid == token
    assert llm.engine.block_manager.num_used_pages == 0


def test_a_rows_bitmask_on_the_host():
    """LogitsControls.restrict: allowed_token_ids, one-token bad words everywhere, a longer bad word's last token
    only after its other tokens, EOS and stop ids only from min_tokens on; contradictory constraints leave EOS."""
    from jaxpage.sample.logits_controls import LogitsControls, token_bitmask
    from jaxpage.sample.logits_processors import unpack_bitmask

    vocab = 70

    def allowed(controls, output, grammar=None) -> set[int]:
        mask = token_bitmask(range(vocab) if grammar is None else grammar, vocab)
        controls.restrict(mask, output)
        return set(np.flatnonzero(np.asarray(unpack_bitmask(mask[None], vocab))[0]).tolist())

    params = SamplingParams(allowed_token_ids=list(range(10, 40)) + [2], min_tokens=2, stop_token_ids=[12])
    controls = LogitsControls.of(params, vocab, [2], bad_word_token_ids=[[20], [30, 31]])
    assert allowed(controls, [10]) == set(range(10, 40)) - {12, 20}  # EOS and the stop id wait for min_tokens
    assert allowed(controls, [10, 11]) == set(range(10, 40)) - {20} | {2}
    assert allowed(controls, [10, 30]) == set(range(10, 40)) - {20, 31} | {2}  # 30 then 31 is a bad word
    assert allowed(controls, [10, 11], grammar=[50, 51]) == {2}  # nothing the grammar takes is allowed: EOS
    assert LogitsControls.of(SamplingParams(), vocab, [2], []) is None  # nothing changes plain requests' logits


def test_speculative_decoding_keeps_the_controlled_greedy_tokens(llm, tiny_dir):
    """Verify steps apply each position's penalties, biases, allowed tokens and min_tokens (the history includes
    the drafts before it): greedy tokens as without speculation, with drafts accepted along the way."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    speculating = LLM(tiny_dir, **TINY_ENGINE, speculative_config=spec)
    speculating.engine.spec_decoder.policy.should_verify = lambda num_seqs, drafts, *shapes: bool(drafts)
    repetitive = [[7, 8, 9, 10] * 5, [30, 31, 30, 31, 30], PROMPTS[2], PROMPTS[0]]
    requests = [{"prompt_token_ids": p} for p in repetitive]
    expected = [o.outputs[0].token_ids for o in llm.generate(requests, CONTROLLED)]
    got = [o.outputs[0].token_ids for o in speculating.generate(requests, CONTROLLED)]
    assert got == expected
    assert speculating.engine.spec_decoding_stats.num_accepted_tokens > 0
