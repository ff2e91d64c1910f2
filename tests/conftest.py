"""Shared fixtures: tiny random Hugging Face models of each family, and the default SmolLM2 model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()


@dataclasses.dataclass(frozen=True)
class TinyFamily:
    name: str
    config_class: str
    kwargs: dict


TINY_COMMON_CONFIG = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, max_position_embeddings=256
)

TINY_FAMILIES = [
    TinyFamily("llama2-mha", "LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0)),
    TinyFamily(
        "llama3-gqa-rope-scaling",
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    TinyFamily(
        "llama-mqa-biases",
        "LlamaConfig",
        dict(num_attention_heads=4, num_key_value_heads=1, attention_bias=True, mlp_bias=True),
    ),
    TinyFamily(
        "llama-linear-rope",
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
        ),
    ),
    TinyFamily(
        "mistral-sliding-window",
        "MistralConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=5, head_dim=16),
    ),
    TinyFamily("qwen2-qkv-bias", "Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
    TinyFamily(
        "qwen3-qk-norm-head-dim", "Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    ),
    TinyFamily(
        "smollm2-tied",
        "LlamaConfig",
        dict(
            num_attention_heads=6, num_key_value_heads=2, hidden_size=96, tie_word_embeddings=True, rope_theta=100000.0
        ),
    ),
]


def make_tiny_hf_model(family: TinyFamily, seed: int = 0) -> transformers.PreTrainedModel:
    """A random float32 model with weights large enough that mistakes show in the logits."""
    config = getattr(transformers, family.config_class)(**{**TINY_COMMON_CONFIG, **family.kwargs})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def hf_logits(model, token_ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().numpy()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """save_pretrained directories of tiny models, made once per family: tiny_model_dir(family) -> Path."""
    cache: dict[str, tuple[Path, transformers.PreTrainedModel]] = {}

    def get(family: TinyFamily) -> tuple[Path, transformers.PreTrainedModel]:
        if family.name not in cache:
            model = make_tiny_hf_model(family)
            directory = tmp_path_factory.mktemp(family.name)
            model.save_pretrained(directory)
            cache[family.name] = (directory, model)
        return cache[family.name]

    return get


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The default model's GGUF file (fetched into the jaxpage cache on first use)."""
    from jaxpage.models.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' own float32 model from the same GGUF file: the reference for jaxpage."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def tiny_dir(tiny_model_dir, smollm2_path, tmp_path_factory):
    """A tiny random model (smollm2-tied, vocab 96) with SmolLM2's tokenizer beside it, so its outputs decode to
    text. Prompts must be token ids below 96: the tokenizer's own ids are larger."""
    import shutil

    from jaxpage.tokenizer import load_tokenizer

    family = next(f for f in TINY_FAMILIES if f.name == "smollm2-tied")
    directory = tmp_path_factory.mktemp("tiny-engine")
    shutil.copytree(tiny_model_dir(family)[0], directory, dirs_exist_ok=True)
    load_tokenizer(smollm2_path).save_pretrained(str(directory))
    return str(directory)
