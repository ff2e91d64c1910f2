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
    "hf_greedy_tokens_split",
    "hf_logits",
    "hf_logits_split",
    "longrope_switch",
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


def longrope_switch(config) -> int | None:
    """A LongRoPE model's original_max_position_embeddings, where jaxpage switches from the short factors to the long
    ones (jaxpage.models.rope.rope_tables); None for other RoPE."""
    params = config.rope_parameters or {}
    return params.get("original_max_position_embeddings") if params.get("rope_type") == "longrope" else None


def _forward_in_pieces(model, token_ids: list[int], split: int):
    """The model's output for one unpadded sequence fed with its KV cache in two pieces, the first `split` tokens and
    the rest (one piece when it is no longer). transformers' LongRoPE picks short or long factors per forward pass by
    the sequence length so far, so the first piece's keys stay rotated with the short factors and every later
    position is rotated with the long ones: jaxpage's per-position rule."""
    import torch

    pieces = [token_ids[:split], token_ids[split:]] if len(token_ids) > split else [token_ids]
    out, start, logits = None, 0, []
    for piece in pieces:
        positions = torch.arange(start, start + len(piece))[None]
        cache = None if out is None else out.cache
        out = model(torch.tensor([piece]), position_ids=positions, cache=cache, use_cache=True)
        logits.append(out.logits[0].float().numpy())
        start += len(piece)
    return out, np.concatenate(logits)


def hf_logits_split(model, token_ids: list[int], split: int) -> np.ndarray:
    """hf_logits with the sequence fed in two pieces at `split` (see _forward_in_pieces)."""
    import torch

    with torch.no_grad():
        return _forward_in_pieces(model, token_ids, split)[1]


def hf_greedy_tokens_split(model, prompts: list[list[int]], num_tokens: int, split: int) -> list[list[int]]:
    """hf_greedy_tokens for a LongRoPE model as jaxpage runs it: one prompt at a time, prefilled in two pieces at
    `split` (see _forward_in_pieces), then argmax decoding with the KV cache."""
    import torch

    results = []
    with torch.no_grad():
        for prompt in prompts:
            out, _ = _forward_in_pieces(model, prompt, split)
            tokens = []
            for position in range(len(prompt), len(prompt) + num_tokens):
                tokens.append(int(out.logits[0, -1].argmax()))
                out = model(
                    torch.tensor([tokens[-1:]]),
                    position_ids=torch.tensor([[position]]),
                    cache=out.cache,
                    use_cache=True,
                )
            results.append(tokens)
    return results
