"""What the tests that compare jaxpage with Hugging Face transformers share. Importing it imports transformers
(and, through the models, torch): only those tests import it; the rest of the suite runs without torch."""

from __future__ import annotations

from transformers.utils import logging as hf_logging

from jaxpage.benchmarks.hf_reference import (
    PARITY_PROMPTS,
    hf_logits,
    load_hf_model,
    load_tiny_hf_model,
    make_tiny_hf_model,
)
from jaxpage.benchmarks.tiny_models import TINY_COMMON_CONFIG, TINY_FAMILIES, TinyFamily

__all__ = [
    "PARITY_PROMPTS",
    "TINY_COMMON_CONFIG",
    "TINY_FAMILIES",
    "TinyFamily",
    "hf_logits",
    "load_hf_model",
    "load_tiny_hf_model",
    "make_tiny_hf_model",
]

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
