"""A pooling model as the pooling engine runs it: its forward pass to the last hidden states over a packed step
(jaxpage.models.attention.PackedBatch) and how it loads.

Two kinds: encoders (BERT, XLM-RoBERTa: jaxpage.models.bert), which attend both ways within each input, and decoder
embedders (the Llama family jaxpage runs, e.g. Qwen3-Embedding), the same decoder as for generation with causal
attention within each input and no KV cache; its LM head is never used.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxpage.config import ModelConfig
from jaxpage.errors import ModelLoadError
from jaxpage.models import bert
from jaxpage.models.attention import PackedAttention, scores_per_pass
from jaxpage.models.hf_loader import read_config_json
from jaxpage.models.llama import build
from jaxpage.models.loader import default_dtype, load_model, resolve_source, source_format
from jaxpage.sources import HubDownload

# Architectures that end so are base models (hidden states out): a pooling model when the runner is left to "auto".
POOLING_SUFFIXES = ("Model", "ForSequenceClassification")


@dataclasses.dataclass(frozen=True)
class PoolingModel:
    """forward(params, token_ids [T], positions [T], batch, token_type_ids [T]) -> hidden [T, hidden_size], jit-able;
    max_positions: the longest input its position embeddings (or RoPE's trained length) take. A sequence
    classification model (rerankers, reward models) has `classify(params, hidden, first_token_index [S]) -> logits
    [S, num_labels]`, its labels' names and HF's problem_type."""

    forward: Callable
    params: dict
    hidden_size: int
    max_positions: int
    is_encoder: bool
    dtype: jnp.dtype
    classify: Callable | None = None
    labels: tuple[str, ...] = ()
    problem_type: str | None = None

    @property
    def num_labels(self) -> int:
        return len(self.labels)


def runner_of(hf: dict) -> str:
    """The runner `auto` picks for a model of config.json `hf`: "pooling" for an encoder or a base model
    (architectures ending in POOLING_SUFFIXES: Qwen3Model, BertModel, ...), else "generate"."""
    if bert.is_encoder_architecture(hf):
        return "pooling"
    architectures = hf.get("architectures") or []
    return "pooling" if any(str(a).endswith(POOLING_SUFFIXES) for a in architectures) else "generate"


def load_pooling_model(directory: Path, hf: dict, dtype=None, load_format: str = "auto") -> PoolingModel:
    """The pooling model of a Hugging Face directory (config.json `hf`), its parameters on the default device.
    ModelLoadError for a decoder's classification head (reward models), which jaxpage does not run yet."""
    dtype = jnp.dtype(dtype) if dtype is not None else default_dtype()
    if bert.is_encoder_architecture(hf):
        config = bert.encoder_config_from_hf(hf, str(directory / "config.json"))
        if load_format == "dummy":
            params = bert.init_encoder_params(config, jax.random.key(0), dtype)
        else:
            params = jax.device_put(bert.load_encoder_params(directory, config, dtype))
        return pooling_model(config, params, dtype)
    heads = [a for a in hf.get("architectures") or [] if str(a).endswith("ForSequenceClassification")]
    if heads:
        raise ModelLoadError(
            f"{directory / 'config.json'}: architecture {heads[0]!r} (a decoder's classification head) is not "
            "supported; jaxpage classifies with BERT and XLM-RoBERTa heads, and embeds with decoders"
        )
    # An embedder is its hidden states: it never reads an LM head. Qwen3-Embedding-4B and -8B declare untied embeddings
    # yet ship no lm_head (Qwen3Model checkpoints): loaded as tied, no head tensor is looked for.
    tied = {"tie_word_embeddings": True}
    config, params = load_model(directory, dtype, load_format=load_format, hf_overrides=tied)
    return pooling_model(config, params, dtype)


def pooling_model(
    config: bert.EncoderConfig | ModelConfig, params: dict, dtype, platform: str | None = None
) -> PoolingModel:
    """The PoolingModel of an encoder's or a decoder's config and parameters (arrays, or ShapeDtypeStructs to
    compile for a chip: jaxpage.aot, which names the chip's `platform`; None: jax's default backend)."""
    dtype = jnp.dtype(dtype)
    if isinstance(config, bert.EncoderConfig):
        module = bert.Encoder(config, dtype, platform)
        classify = None if config.head_kind is None else functools.partial(_encoder_classify, module)
        forward = functools.partial(_encoder_forward, module)
        shape = (config.hidden_size, config.max_sequence_length, True, dtype)
        return PoolingModel(forward, params, *shape, classify, config.id2label, config.problem_type)
    module = build(
        config,
        PackedAttention(config.attention_scale, causal=True, scores_per_pass=scores_per_pass(platform)),
        dtype,
        platform=platform,
    )
    forward = functools.partial(_decoder_forward, module)
    return PoolingModel(forward, params, config.hidden_size, config.max_position_embeddings, False, dtype)


def _encoder_forward(module, params, token_ids, positions, batch, token_type_ids):
    return module.apply({"params": params}, token_ids, positions, batch, token_type_ids)


def _encoder_classify(module, params, hidden, first_token_index):
    return module.apply({"params": params}, hidden, first_token_index, method=bert.Encoder.classify)


def _decoder_forward(module, params, token_ids, positions, batch, token_type_ids):
    return module.apply({"params": params}, token_ids, positions, batch)[0]


def engine_runner(model: str | None, runner: str, download: HubDownload) -> str:
    """ "generate" or "pooling": the engine argument runner, or with "auto" the model's (runner_of; a GGUF file or a
    jaxpage checkpoint generates)."""
    if runner != "auto":
        return runner
    path = resolve_source(model, download, weights=False)
    return runner_of(read_config_json(path)) if source_format(path) == "hf" else "generate"
