"""Perplexity of a model on a text, in windows (tests and scripts/bench_quantization): by the cache-free forward
pass, or through the paged KV pool in any kv_cache_dtype (the engine's attention path, prefill of each window)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from jaxpage.config import ModelConfig

# Chapter I of Lewis Carroll's Alice's Adventures in Wonderland (1865, public domain): ~2700 tokens of English.
TEXT_PATH = Path(__file__).resolve().parents[2] / "tests" / "data" / "alice_chapter_1.txt"


def perplexity(
    config: ModelConfig, params: dict, token_ids: list[int], window: int = 512, kv_cache_dtype: str | None = None
) -> float:
    """exp(mean negative log-likelihood) of each token after the first, each window of `window` tokens predicted
    from its own start (no context carried over).

    kv_cache_dtype None: the cache-free forward pass. Else ("auto", "int8", "fp8_e4m3", "fp8_e5m2"): each window is
    one prefill through a KV page pool of that format, the engine's path (AttentionBackend "xla"): every token's K/V
    is written into the pool, then read back from it by the attention."""
    return teacher_forced(config, params, token_ids, window, kv_cache_dtype)[0]


def teacher_forced(
    config: ModelConfig, params: dict, token_ids: list[int], window: int = 512, kv_cache_dtype: str | None = None
) -> tuple[float, list[int]]:
    """(perplexity, greedy) of `perplexity`'s passes: greedy[i] is the most likely token after token_ids[: i + 1]
    within its window (the model's greedy choice given the text so far: teacher forcing)."""
    from jaxpage.models import forward  # jax: not at import (the benchmark helpers import without it)

    nll, count, greedy = 0.0, 0, []
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start : start + window + 1]
        if kv_cache_dtype is None:
            logits = np.asarray(forward(config, params, [chunk[:-1]]))[0]
        else:
            logits = np.asarray(_paged_logits(config, params, np.asarray(chunk[:-1], np.int32), kv_cache_dtype))
        logits = logits.astype(np.float64)
        greedy += logits.argmax(-1).tolist()
        top = logits.max(-1, keepdims=True)
        logprobs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        nll -= logprobs[np.arange(len(chunk) - 1), chunk[1:]].sum()
        count += len(chunk) - 1
    return float(np.exp(nll / count)), greedy


def _paged_logits(config: ModelConfig, params: dict, token_ids: np.ndarray, kv_cache_dtype: str):
    """float32 logits [n, vocab] of one sequence's prefill of token_ids [n] into a fresh pool."""
    from jaxpage.attention import resolve_backend

    return _paged_prefill()(config, params, token_ids, resolve_backend("xla", kv_cache_dtype))


@functools.cache
def _paged_prefill(page_size: int = 16):
    """The jitted prefill of `_paged_logits` (made at first use: jax is imported then)."""
    import jax
    import jax.numpy as jnp

    from jaxpage.attention import PagedAttention, PagedBatch
    from jaxpage.models.llama import Llama, build, params_dtype

    @functools.partial(jax.jit, static_argnums=(0, 3))
    def prefill(config, params, token_ids, backend):
        n = token_ids.shape[0]
        num_pages = -(-n // page_size)
        dtype = params_dtype(params)
        layout = backend.pool_layout(config, num_pages + 1, page_size, dtype)  # page 0: the null page
        kv_cache = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), layout)
        batch = PagedBatch(
            slot_mapping=page_size + jnp.arange(n, dtype=jnp.int32),
            block_tables=jnp.arange(1, num_pages + 1, dtype=jnp.int32)[None],
            kv_lens=jnp.array([n], jnp.int32),
            cu_q_lens=jnp.array([0, n], jnp.int32),
            num_seqs=jnp.int32(1),
        )
        model = build(config, PagedAttention(backend, config.attention_scale, config.sliding_window), dtype)
        variables = {"params": params}
        hidden, _ = model.apply(variables, token_ids, jnp.arange(n, dtype=jnp.int32), batch, kv_cache)
        return model.apply(variables, hidden, method=Llama.logits)

    return prefill
