"""Max |logit difference| between jaxpage and transformers, per tiny test family and on SmolLM2.

    python tests/parity_report.py

Uses the tiny random families the tests use (tests/tiny_models.py: float32, a 24-token prompt) and the
default model on three real prompts; needs the test extras (torch). Prints one line per model.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hf_reference import PARITY_PROMPTS, hf_logits, load_hf_model, load_tiny_hf_model
from tiny_models import TINY_FAMILIES, write_tiny_model

from jaxpage.models import forward, load_model
from jaxpage.models.default_model import default_model_path
from jaxpage.tokenizers.tokenizer import encode_prompt, load_tokenizer


def main() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    for family in TINY_FAMILIES:
        with tempfile.TemporaryDirectory() as tmp:
            directory = write_tiny_model(family, Path(tmp))
            model = load_tiny_hf_model(directory)
            config, params = load_model(directory)
        prompt = np.random.default_rng(0).integers(0, config.vocab_size, 24).tolist()
        diff = np.abs(np.asarray(forward(config, params, [prompt]))[0] - hf_logits(model, prompt)).max()
        print(f"{family.name:>28}: max |diff| {diff:.2e}")

    path = default_model_path()
    reference = load_hf_model(path)
    config, params = load_model(path)
    tokenizer = load_tokenizer(path)
    for prompt in PARITY_PROMPTS:
        ids = encode_prompt(tokenizer, prompt)
        ours = np.asarray(forward(config, params, [ids]))[0]
        theirs = hf_logits(reference, ids)
        agree = (ours.argmax(-1) == theirs.argmax(-1)).mean()
        print(
            f"{'SmolLM2 ' + str(len(ids)) + ' tokens':>28}: max |diff| {np.abs(ours - theirs).max():.2e}, "
            f"argmax agreement {agree:.0%}"
        )


if __name__ == "__main__":
    main()
