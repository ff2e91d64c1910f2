"""The speculative_config argument: vLLM's keys and defaults, and refusals that name the key."""

from __future__ import annotations

import pytest

from jaxpage.config import SpeculativeConfig
from jaxpage.validation import ArgumentTypeError


def test_ngram_sizes_default_as_in_vllm():
    ngram = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3})
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)
    both = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 3}'
    assert SpeculativeConfig.from_value(both) == SpeculativeConfig("ngram", 4, 3, 5)  # the CLI's JSON


def test_a_model_without_a_method_is_a_draft_model():
    config = SpeculativeConfig.from_value({"model": "/models/draft.gguf", "num_speculative_tokens": 2})
    assert config == SpeculativeConfig("draft_model", 2, model="/models/draft.gguf")
    assert SpeculativeConfig.from_value(None) is None and SpeculativeConfig.from_value(config) is config


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, r"speculative_config\['method'\] must be 'ngram' or"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"num_speculative_tokens": 3}, "needs 'method'"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            r"\['num_speculative_tokens'\] must be an integer in \[1, 16\]",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            r"\['prompt_lookup_min'\] must be <= prompt_lookup_max \(2\), got 4",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0},
            r"\['prompt_lookup_max'\] must be an integer in \[1, 64\], got 0",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "model": "x"},
            r"\['model'\] must be left out with method 'ngram'",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 3}, r"\['model'\] must be the draft model"),
        (
            {"method": "draft_model", "model": "m", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
            "it is an n-gram setting",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "speculative_model": "x"},
            r"unknown keys \['speculative_model'\]",
        ),
        ("{not json", "must be a JSON object"),
    ],
)
def test_bad_configs_are_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_value(value)


def test_wrong_types_are_type_errors():
    with pytest.raises(ArgumentTypeError, match="num_speculative_tokens"):
        SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 2.5})
    with pytest.raises(ArgumentTypeError, match="speculative_config must be a dict"):
        SpeculativeConfig.from_value([("method", "ngram")])
    with pytest.raises(ArgumentTypeError, match=r"\['method'\]"):
        SpeculativeConfig.from_value({"method": None, "num_speculative_tokens": 2})
