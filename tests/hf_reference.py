"""What the tests that compare jaxpage with Hugging Face transformers share. Importing it imports transformers
(and, through the models, torch): only those tests import it; the rest of the suite runs without torch."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from tiny_models import TINY_COMMON_CONFIG, TINY_FAMILIES, TinyFamily, write_tiny_model
from transformers.utils import logging as hf_logging

from jaxpage.benchmarks.hf_baselines import load_hf_model

__all__ = [
    "PARITY_PROMPTS",
    "TINY_COMMON_CONFIG",
    "TINY_FAMILIES",
    "TinyFamily",
    "hf_greedy_tokens",
    "hf_logits",
    "load_hf_model",
    "load_tiny_hf_model",
    "make_tiny_hf_model",
]

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

# Real prompts for the default model (SmolLM2-135M-Instruct): a fact, code, a story.
PARITY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter who",
]


def load_tiny_hf_model(directory: Path):
    """transformers' float32 eager-attention model from a directory write_tiny_model wrote; ValueError unless
    transformers found every tensor it expects, with the shape it expects, and no other."""
    import torch
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    problems = {kind: names for kind, names in info.items() if names}
    if problems:
        raise ValueError(f"{directory}: transformers did not load the tensors as written: {problems}")
    return model.eval()


def make_tiny_hf_model(family: TinyFamily, seed: int = 0):
    """transformers' model of the family with write_tiny_model's weights (for the same seed)."""
    with tempfile.TemporaryDirectory() as tmp:
        return load_tiny_hf_model(write_tiny_model(family, Path(tmp), seed))


def hf_logits(model, token_ids: list[int]) -> np.ndarray:
    """The model's float32 logits for one unpadded sequence: [len(token_ids), vocab]."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().numpy()


def hf_greedy_tokens(model, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Plain argmax decoding with transformers' KV cache, every prompt in one batch: padded on the left, masked, each
    row's positions from 0. (generate's min_new_tokens would mask EOS, which vLLM's ignore_eos does not: it only
    keeps going after EOS.)"""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    tokens = []
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=positions, use_cache=True)
        for _ in range(num_tokens):
            token = out.logits[:, -1].argmax(-1)
            tokens.append(token)
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], -1)
            positions = positions[:, -1:] + 1
            out = model(
                token[:, None], attention_mask=mask, position_ids=positions, past_key_values=out.past_key_values
            )
    return torch.stack(tokens, 1).tolist()
