"""The whole-request timers of scripts/bench_latency.py (jaxpage.benchmarks.request_latency) on a tiny model: each
timed call's figures are consistent with the call (a first token before the last, one gap per later token)."""

from __future__ import annotations

import pytest
from tiny_models import TINY_ENGINE

from jaxpage.benchmarks.request_latency import gaps, summary, time_generate, time_hf_generate
from jaxpage.entrypoints.llm import LLM

PROMPTS = [{"prompt_token_ids": [(7 * i + k) % 90 + 3 for k in range(12)]} for i in range(4)]


def test_gaps_and_summary_take_medians_of_the_repeats():
    assert gaps([1.0, 1.5, 3.0]) == [0.5, 1.5]
    figures = summary([2.0, 4.0, 3.0], [0.1, 0.3, 0.2], [0.5, 1.5, 1.0, 9.0], tokens=6)
    assert figures == {"request_s": 3.0, "ttft_s": 0.2, "itl_s": 1.25, "tokens_per_s": 2.0, "repeats": 3}


def test_generate_is_timed_whole_and_its_stream_token_by_token(tiny_dir):
    llm = LLM(tiny_dir, **TINY_ENGINE)
    figures = time_generate(llm, PROMPTS, max_tokens=5)  # two calls of generate, two streams
    assert figures["repeats"] == 2
    assert 0 < figures["ttft_s"] < figures["request_s"] * 3
    assert 0 < figures["itl_s"] < figures["request_s"]
    assert figures["tokens_per_s"] == pytest.approx(5 / figures["request_s"])


def test_transformers_generate_is_timed_the_same_way(tiny_model_dir):
    from tiny_models import TINY_FAMILIES

    _, hf = tiny_model_dir(TINY_FAMILIES[0])
    hf.generation_config.eos_token_id = None
    figures = time_hf_generate(hf, [p["prompt_token_ids"] for p in PROMPTS[:2]], max_tokens=5)
    assert figures["repeats"] == 2
    assert 0 < figures["ttft_s"] < figures["request_s"]
    assert 0 < figures["itl_s"] < figures["request_s"]
