"""transformers' models as the reference jaxpage's logits are compared with (torch and transformers are test
extras: imported inside these functions)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from jaxpage.benchmarks.tiny_models import TinyFamily, write_tiny_model

# Real prompts for the default model (SmolLM2-135M-Instruct): a fact, code, a story.
PARITY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter who",
]


def load_hf_model(path: Path, attn_implementation: str | None = None):
    """transformers' float32 model, in eval mode, from a .gguf file (dequantized by transformers) or an HF
    directory."""
    import torch
    import transformers

    path = Path(path)
    kwargs = dict(dtype=torch.float32, attn_implementation=attn_implementation)
    if path.suffix == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    return model.eval()


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
