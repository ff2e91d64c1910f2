"""Perplexity of a model on a text, by the cache-free forward pass in windows (tests and scripts/bench_quantization)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxpage.config import ModelConfig

# Chapter I of Lewis Carroll's Alice's Adventures in Wonderland (1865, public domain): ~2700 tokens of English.
TEXT_PATH = Path(__file__).resolve().parents[2] / "tests" / "data" / "alice_chapter_1.txt"


def perplexity(config: ModelConfig, params: dict, token_ids: list[int], window: int = 512) -> float:
    """exp(mean negative log-likelihood) of each token after the first, each window of `window` tokens predicted
    from its own start (no context carried over)."""
    from jaxpage.models import forward  # jax: not at import (the benchmark helpers import without it)

    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start : start + window + 1]
        logits = np.asarray(forward(config, params, [chunk[:-1]]))[0].astype(np.float64)
        top = logits.max(-1, keepdims=True)
        logprobs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        nll -= logprobs[np.arange(len(chunk) - 1), chunk[1:]].sum()
        count += len(chunk) - 1
    return float(np.exp(nll / count))
