"""lm-eval's `local-completions` model against a live jaxpage server, on the two tasks tests/data/lm_eval ships (a
loglikelihood task and a generate_until task, found through include_path), as people evaluate a vLLM server: token-id
prompts several to a request, echo with logprobs, and the server's own tokenizer (lm-eval's remote tokenizer over
/tokenizer_info, /tokenize and /detokenize). Its loglikelihoods equal those computed offline from LLM.generate's
prompt_logprobs; its generations equal LLM.generate's greedy text."""

from __future__ import annotations

import math
from pathlib import Path

import lm_eval
import pytest
from live_server import LiveServer
from tiny_models import FULL_VOCAB_ENGINE

from jaxpage.entrypoints.async_engine import AsyncEngine
from jaxpage.entrypoints.llm import LLM
from jaxpage.entrypoints.server import create_app
from jaxpage.sampling_params import SamplingParams

TASKS = Path(__file__).parent / "data" / "lm_eval"
ENGINE = FULL_VOCAB_ENGINE


@pytest.fixture(scope="module")
def reference(full_vocab_dir):
    return LLM(full_vocab_dir, **ENGINE)


@pytest.fixture(scope="module")
def results(full_vocab_dir):
    from lm_eval.tasks import TaskManager

    engine = AsyncEngine(LLM(full_vocab_dir, **ENGINE).engine).start()
    server = LiveServer(create_app(engine, "tiny", api_key="sesame"))
    model_args = {
        "base_url": f"{server.url}/v1/completions", "model": "tiny", "tokenizer_backend": "remote",
        "auth_token": "sesame", "max_length": 96, "max_gen_toks": 8, "batch_size": 3, "max_retries": 1,
    }  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OPENAI_API_KEY", "sesame")  # the key lm-eval's requests send (auth_token: its remote tokenizer's)
        try:
            yield lm_eval.simple_evaluate(
                model="local-completions",
                model_args=model_args,
                tasks=["jaxpage_choice", "jaxpage_generate"],
                task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),  # not its thousands of tasks
                log_samples=True,
            )
        finally:
            server.stop()
            engine.shutdown(timeout_s=5)


def offline_loglikelihood(llm: LLM, context: str, continuation: str) -> float:
    """log P(continuation | context) from LLM.generate's prompt_logprobs, the tokens split as lm-eval splits them
    (trailing spaces of the context move to the continuation; the whole is encoded, the context's tokens cut off)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    tokenizer = llm.get_tokenizer()
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    start = len(tokenizer(context, add_special_tokens=False).input_ids)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    logprobs = llm.generate([{"prompt_token_ids": whole}], params)[0].prompt_logprobs
    return sum(logprobs[i][token].logprob for i, token in enumerate(whole) if i >= start)


def test_loglikelihoods_equal_the_offline_computation(results, reference):
    samples = results["samples"]["jaxpage_choice"]
    assert len(samples) == 4
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"], strict=True):
            loglikelihood = response[0][0]
            assert math.isfinite(loglikelihood) and loglikelihood < 0
            assert loglikelihood == pytest.approx(offline_loglikelihood(reference, context, continuation), abs=1e-4)
    assert 0 <= results["results"]["jaxpage_choice"]["acc,none"] <= 1


def test_generate_until_gives_llm_generates_greedy_text(results, reference):
    samples = results["samples"]["jaxpage_generate"]
    assert len(samples) == 3
    for sample in samples:
        context, kwargs = sample["arguments"][0]
        assert kwargs["max_gen_toks"] == 8
        want = reference.generate([context], SamplingParams(temperature=0, max_tokens=8, stop=["\n"]))[0]
        assert sample["resps"][0][0] == want.outputs[0].text
    assert "exact_match,none" in results["results"]["jaxpage_generate"]
