"""The device's step stubbed out, for the benchmarks of the host's work (scripts/bench_host.py,
scripts/bench_serve_loop.py): a model of the default model's shape at its ends (its 49,152-token vocabulary and its
tokenizer, two small layers, random weights: load_format="dummy") whose runner's step draws each sampling row's token
on the host from English text (never EOS), with random log-probs where asked."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

# The default model's shape at its ends (vocabulary, tokenizer), two small layers: the device's work is nothing to
# speak of, and the stub does it anyway.
TINY_FULL_VOCAB = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
)


def write_tiny_full_vocab(directory: str) -> str:
    """directory, with TINY_FULL_VOCAB's config.json in it (no weights: load it with load_format="dummy")."""
    (Path(directory) / "config.json").write_text(json.dumps(TINY_FULL_VOCAB))
    return directory


class StubDevice:
    """Replaces a ModelRunner's step (its forward pass and sampler) with tokens drawn on the host from `tokens`, and
    counts its own seconds (`seconds`), which are not the engine's host work."""

    def __init__(self, runner, tokens: np.ndarray, top_logprobs: int):
        import jax

        self.jax = jax
        self.runner = runner
        self.tokens = tokens
        self.top = top_logprobs
        self.rng = np.random.default_rng(0)
        self.seconds = 0.0
        runner._run_step = self.run_step

    def run_step(self, shape, step, sample_input, level) -> tuple:
        start = time.perf_counter()
        rows, k = shape.sample_rows, shape.num_draft_positions
        token_ids = self.tokens[self.rng.integers(0, len(self.tokens), (rows, k + 1))].astype(np.int32)
        logprobs = (
            -self.rng.random((rows, k + 1), np.float32),
            self.rng.integers(0, 49152, (rows, k + 1, self.top), dtype=np.int32),
            -self.rng.random((rows, k + 1, self.top), np.float32),
        )
        put = self.jax.device_put
        results = (put(token_ids), put(np.zeros(rows, np.int32)), tuple(put(x) for x in logprobs))
        last = np.zeros(self.runner.inputs.max_sample_rows, np.int32)
        last[:rows] = token_ids[:, 0]
        self.runner.last_tokens = put(last)
        self.seconds += time.perf_counter() - start
        return results


def install_stub_device(engine) -> StubDevice:
    """engine's runner stubbed: its tokens drawn from the benchmarks' English corpus as engine's tokenizer reads it,
    without its EOS ids."""
    from jaxpage.benchmarks.workloads import corpus_text
    from jaxpage.sampling_params import SamplingParams

    eos = {engine.tokenizer.eos_token_id, *engine.model_config.eos_token_ids}
    corpus = np.asarray(engine.tokenizer(corpus_text()).input_ids, np.int64)
    return StubDevice(engine.runner, corpus[~np.isin(corpus, list(eos))], SamplingParams.MAX_LOGPROBS)


def stubbed_engine(config):
    """An LLMEngine of EngineConfig config with its device stubbed (for EngineProcess's make_engine)."""
    from jaxpage.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    install_stub_device(engine)
    return engine
