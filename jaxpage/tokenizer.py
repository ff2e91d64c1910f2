"""Tokenizers: transformers' tokenizer from a model directory, a jaxpage checkpoint or a GGUF file."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from jaxpage.errors import ModelLoadError
from jaxpage.models.loader import resolve_source, source_format


def load_tokenizer(source: str | os.PathLike | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template) of the same `source` that `load_model` takes."""
    path = resolve_source(source)
    try:
        if source_format(path) == "gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoTokenizer.from_pretrained(str(path))
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{path}: cannot load a tokenizer ({type(e).__name__}: {e})") from None


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of `prompt`; with `chat`, of a one-turn user conversation under the chat template."""
    if chat:
        if not tokenizer.chat_template:
            raise ValueError("this model's tokenizer has no chat template; run without chat")
        messages = [{"role": "user", "content": prompt}]
        return list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
    return list(tokenizer(prompt).input_ids)
