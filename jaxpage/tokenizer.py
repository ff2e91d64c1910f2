"""Tokenizers: transformers' tokenizer from a model directory, a jaxpage checkpoint or a GGUF file."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from jaxpage.errors import ModelLoadError
from jaxpage.models.default_model import cache_dir
from jaxpage.models.loader import resolve_source, source_format


def load_tokenizer(source: str | os.PathLike | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template) of the same `source` that `load_model` takes.

    A GGUF file's tokenizer is built from its metadata once (seconds: the vocabulary is parsed from the
    file) and kept in the jaxpage cache, keyed by the file's path, size and modification time.
    """
    path = resolve_source(source)
    try:
        if source_format(path) == "gguf":
            return _gguf_tokenizer(path)
        return AutoTokenizer.from_pretrained(str(path))
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{path}: cannot load a tokenizer ({type(e).__name__}: {e})") from None


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of `prompt`; with `chat`, of a one-turn user conversation under the chat template."""
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt).input_ids)


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Token ids of a conversation ([{"role": ..., "content": ...}, ...]) under the chat template, ready for the
    assistant's reply. ValueError when the tokenizer has no chat template."""
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template")
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    stat = path.resolve().stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:20]
    cached = cache_dir() / "gguf-tokenizers" / key
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, cached)  # atomic: a reader never sees half a tokenizer
            os.mkdir(tmp)  # for TemporaryDirectory's clean-up
    except OSError:
        pass  # a read-only or full cache costs only speed
    return tokenizer


class IncrementalDetokenizer:
    """Text of a growing list of output tokens, one token at a time, correct across multi-byte characters.

    A byte-level token may end in the middle of a UTF-8 character; its text is held back (decoding gives
    U+FFFD) until the tokens that complete it arrive. The last few prompt tokens are decoded along as
    context, so tokenizers that drop a leading space when decoding a lone token still get it right.
    """

    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids[-self.CONTEXT_TOKENS :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Appends a token; returns the text it completes (possibly empty)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip_special)
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta
