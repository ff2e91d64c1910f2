"""Speculative decoding with a draft model (a second, smaller model with its own page pool) on tiny random models:
greedy output token for token the output without speculation (chunked prefill, preemption, shared pages), sampled
tokens with plain sampling's distribution, the draft model run only in steps that verify, and a draft model must
share the target's tokens."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats
from test_spec_decode import ENGINES, completions, make_llm, prompts, without_float_ties
from tiny_models import TinyFamily, write_tiny_model

from jaxpage.sampling_params import SamplingParams

TARGET = TinyFamily("target", "LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2))
SMALL_DRAFT = TinyFamily(  # a smaller, different random model with the same vocabulary and special tokens
    "draft", "LlamaConfig", dict(num_attention_heads=2, num_key_value_heads=1, hidden_size=32, num_hidden_layers=1)
)


def draft_config(model: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def draft_pair(tmp_path_factory):
    """(target, a smaller draft): tiny random models with weights on disk (a draft model loads its own weights)."""
    return (
        str(write_tiny_model(TARGET, tmp_path_factory.mktemp("target"))),
        str(write_tiny_model(SMALL_DRAFT, tmp_path_factory.mktemp("draft"), seed=1)),
    )


# The target as its own draft (every draft token accepted) and a smaller model (some rejected) beside one plain
# engine; the tight pool (chunked prefills, preemption) with the smaller model.
@pytest.mark.parametrize(
    ("engine", "drafts"), [("roomy", ("target itself", "smaller model")), ("tight", ("smaller model",))]
)
def test_draft_model_greedy_output_is_the_same(draft_pair, engine, drafts):
    target, small = draft_pair
    plain = make_llm(target, load_format="auto", **ENGINES[engine])
    requests = without_float_ties(plain, prompts(16, seed=10), 32)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = completions(plain.generate(requests, params))
    for draft in drafts:
        spec = make_llm(
            target, draft_config(target if draft == "target itself" else small), load_format="auto", **ENGINES[engine]
        )
        assert completions(spec.generate(requests, params)) == want, draft
        stats_ = spec.engine.spec_decoding_stats
        assert stats_.num_drafts > 10
        if draft == "target itself":  # the target's own greedy tokens: every one accepted
            assert stats_.num_accepted_tokens == stats_.num_draft_tokens
        else:
            assert stats_.num_accepted_tokens < stats_.num_draft_tokens
        spec.engine.block_manager.check_invariants()
        assert spec.engine.block_manager.num_used_pages == 0
        if engine == "tight":
            assert spec.engine.scheduler.num_preemptions > 0


def test_draft_model_sampling_keeps_the_distribution(tmp_path):
    """Rejection sampling against a draft model's own distribution: the joint distribution of the first three
    tokens matches plain sampling's (chi-square test of homogeneity, 2400 seeded requests each), with a draft model
    whose distribution differs from the target's (some drafts rejected, some accepted)."""
    vocab = 4
    family = lambda f: TinyFamily(f.name, f.config_class, f.kwargs | dict(vocab_size=vocab))  # noqa: E731
    target = str(write_tiny_model(family(TARGET), tmp_path / "target"))
    draft = str(write_tiny_model(family(SMALL_DRAFT), tmp_path / "draft", seed=1))
    args = dict(load_format="auto", max_num_seqs=256, max_num_batched_tokens=4096, num_pages=2000)
    spec_llm, plain_llm = make_llm(target, draft_config(draft, k=2), **args), make_llm(target, **args)
    prompt = {"prompt_token_ids": [0, 1, 2, 3, 3, 1]}
    count = 2400
    for setting in (dict(temperature=1.0), dict(temperature=0.8, top_k=3)):
        params = [SamplingParams(seed=i, max_tokens=3, ignore_eos=True, **setting) for i in range(count)]
        before = spec_llm.engine.spec_decoding_stats.copy()
        spec = [c[0][0] for c in completions(spec_llm.generate([prompt] * count, params))]
        verified = spec_llm.engine.spec_decoding_stats.since(before)
        assert verified.num_drafts >= count // 5  # a step drafts only when no sequence prefills
        assert 0 < verified.num_accepted_tokens < verified.num_draft_tokens
        plain = [c[0][0] for c in completions(plain_llm.generate([prompt] * count, params))]
        cells = sorted(set(spec) | set(plain))
        table = np.array([[sample.count(cell) for cell in cells] for sample in (spec, plain)])
        table = table[:, table.sum(axis=0) >= 10]
        p_value = stats.chi2_contingency(table).pvalue
        assert p_value > 1e-3, (setting, p_value)


def test_a_draft_model_must_speak_the_targets_tokens(draft_pair, tmp_path):
    target, _ = draft_pair
    other_vocab = write_tiny_model(
        TinyFamily("v", "LlamaConfig", SMALL_DRAFT.kwargs | dict(vocab_size=80)), tmp_path / "vocab"
    )
    with pytest.raises(ValueError, match=r"vocabulary has 80 tokens, the target's 96"):
        make_llm(target, draft_config(str(other_vocab)), load_format="auto")
    other_eos = write_tiny_model(
        TinyFamily("e", "LlamaConfig", SMALL_DRAFT.kwargs | dict(eos_token_id=5)), tmp_path / "eos"
    )
    with pytest.raises(
        ValueError, match=r"special tokens differ from the target's \(eos_token_ids \(5,\) against \(2,\)\)"
    ):
        make_llm(target, draft_config(str(other_eos)), load_format="auto")
    with pytest.raises(ValueError, match="no such file"):
        make_llm(target, draft_config(str(tmp_path / "missing")), load_format="auto")


def test_draft_model_with_shared_pages(draft_pair):
    """n > 1 (samples share the prompt's pages, the last one copied on write) and prefix-cache hits (pages another
    request computed): the draft model's pool follows the target's, so the output is the same."""
    target, small = draft_pair
    shared = list(range(5, 45))
    requests = [{"prompt_token_ids": shared + [i, i + 1, i + 2]} for i in range(50, 56)]
    params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
    plain = make_llm(target, load_format="auto", page_size=8)
    spec = make_llm(target, draft_config(target), load_format="auto", page_size=8)
    want = completions(plain.generate(requests, params))
    assert completions(spec.generate(requests, params)) == want
    stats_ = spec.engine.spec_decoding_stats
    assert stats_.num_drafts > 10 and stats_.num_accepted_tokens == stats_.num_draft_tokens  # its own draft
    assert spec.engine.scheduler.num_prefix_hit_tokens > 0


@pytest.mark.parametrize("engine", ["roomy", "tight"])
def test_a_draft_model_runs_only_in_steps_that_verify(draft_pair, engine):
    """Steps that do not verify (prefill, and decode steps the speculation policy declines: here two in three) do
    not run the draft model; when it drafts again it first computes the tokens it missed. With the target as its
    own draft every draft token is then accepted: its pool holds the right K/V, through chunked prefill and
    preemption."""
    target, _ = draft_pair
    requests = prompts(16, seed=11)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = make_llm(target, load_format="auto", **ENGINES[engine])
    spec = make_llm(target, draft_config(target), always_verify=False, load_format="auto", **ENGINES[engine])
    offers = iter(range(10**6))
    spec.engine.spec_decoder.policy.should_verify = lambda num_seqs, drafts, *shapes: next(offers) % 3 == 0
    runner = spec.engine.draft_runner
    calls = {"propose": 0, "catch_up": 0}

    def counted(name, method):
        def call(*args):
            calls[name] += 1
            return method(*args)

        return call

    runner.propose, runner.catch_up = counted("propose", runner.propose), counted("catch_up", runner.catch_up)
    assert completions(spec.generate(requests, params)) == completions(plain.generate(requests, params))
    stats_ = spec.engine.spec_decoding_stats
    assert stats_.num_drafts > 10 and stats_.num_accepted_tokens == stats_.num_draft_tokens
    assert calls["propose"] == calls["catch_up"] < next(offers) / 2  # only in the steps that verified
    if engine == "tight":
        assert spec.engine.scheduler.num_preemptions > 0
