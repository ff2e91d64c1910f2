"""Max |logit difference| between jaxpage and transformers, per tiny test family and on SmolLM2.

    python scripts/parity_report.py

Uses the tiny random families of tests/conftest.py (float32, a 24-token prompt) and the default
model on three real prompts; needs the test extras (torch). Prints one line per model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import TINY_FAMILIES, hf_logits, make_tiny_hf_model  # noqa: E402
from test_gguf import PROMPTS  # noqa: E402

from jaxpage.models import forward, load_model  # noqa: E402
from jaxpage.models.default_model import default_model_path  # noqa: E402
from jaxpage.tokenizer import encode_prompt, load_tokenizer  # noqa: E402


def main() -> None:
    import tempfile

    import transformers

    for family in TINY_FAMILIES:
        model = make_tiny_hf_model(family)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            config, params = load_model(tmp)
        prompt = np.random.default_rng(0).integers(0, config.vocab_size, 24).tolist()
        diff = np.abs(np.asarray(forward(config, params, [prompt]))[0] - hf_logits(model, prompt)).max()
        print(f"{family.name:>28}: max |diff| {diff:.2e}")

    path = default_model_path()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    config, params = load_model(path)
    tokenizer = load_tokenizer(path)
    for prompt in PROMPTS:
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
