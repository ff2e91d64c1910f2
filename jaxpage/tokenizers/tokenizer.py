"""Tokenizers: transformers' tokenizer from a model directory, a jaxpage checkpoint or a GGUF file."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from jaxpage.errors import ModelLoadError
from jaxpage.models.default_model import cache_dir, default_model_path
from jaxpage.models.loader import source_format
from jaxpage.sources import DEFAULT_DOWNLOAD, HubDownload, resolve_tokenizer
from jaxpage.tokenizers.chat_template import read_chat_template
from jaxpage.tokenizers.gguf_tokenizer import GGUF_TOKENIZER_BUILDER_VERSION, load_gguf_tokenizer
from jaxpage.validation import check_text, describe, fail

if TYPE_CHECKING:  # transformers takes most of a second to import: the functions that need it import it
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(
    source: str | os.PathLike | None = None, download: HubDownload = DEFAULT_DOWNLOAD, chat_template: str | None = None
) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template) of the same `source` that `load_model` takes, or of a tokenizer's own
    directory or Hub id (of which only the tokenizer's files are downloaded, at `download`'s revision and place).
    `chat_template`: a template that replaces the tokenizer's (a file, or the template itself: read_chat_template).

    A GGUF file's tokenizer is built from its metadata once (seconds: the vocabulary is parsed from the
    file) and kept in the jaxpage cache, keyed by the file's path, size and modification time.
    """
    template = None if chat_template is None else read_chat_template(chat_template)
    path = default_model_path() if source is None else resolve_tokenizer(source, download)
    tokenizer = _load_tokenizer(path)
    if template is not None:
        tokenizer.chat_template = template
    _check_tokenizer(tokenizer, path)
    return tokenizer


def _check_tokenizer(tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    """ModelLoadError naming `path` for a tokenizer that loads but cannot work (junk such as a model_max_length that is
    a string loads, then fails every request): it must encode and decode text, and its chat template be text."""
    try:
        tokenizer.decode(tokenizer("Hello, world!").input_ids)
    except Exception as e:
        problem = f"it cannot encode text: {type(e).__name__}: {e}"
        raise ModelLoadError(f"{path}: cannot load a tokenizer ({problem})") from None
    template = tokenizer.chat_template
    if template is not None and not (
        isinstance(template, str) or (isinstance(template, dict) and all(isinstance(t, str) for t in template.values()))
    ):
        raise ModelLoadError(
            f"{path}: cannot load a tokenizer (chat_template must be a Jinja template, got {describe(template)})"
        )


def _load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """A GGUF file's tokenizer, or transformers' of a directory (a model's, a checkpoint's, or a tokenizer's own)."""
    try:
        if path.is_file() and source_format(path) == "gguf":
            return _gguf_tokenizer(path)
        import transformers  # transformers.AutoTokenizer imports torch where installed: only model directories use it

        return transformers.AutoTokenizer.from_pretrained(str(path))
    except ModelLoadError:
        raise
    except Exception as e:  # junk in tokenizer files trips transformers: TypeError, AttributeError, KeyError, ...
        raise ModelLoadError(f"{path}: cannot load a tokenizer ({type(e).__name__}: {e})") from None


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of `prompt`; with `chat`, of a one-turn user conversation under the chat template."""
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt).input_ids)


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of a conversation ([{"role": ..., "content": ...}, ...]) under the chat template, ready for the
    assistant's reply; `tools` (OpenAI's function definitions) are given to the template, which may show them to
    the model. Messages are checked first (see `check_messages`). ValueError when a message is malformed, the
    tokenizer has no chat template, or the template refuses the conversation (its message says why)."""
    messages = check_messages(messages)
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template")
    try:
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as e:  # jinja2's TemplateError (the template's raise_exception), or anything it trips on
        raise ValueError(f"the chat template cannot render these messages ({type(e).__name__}: {e})") from None
    if not ids:
        raise ValueError("the chat template renders these messages as no tokens")
    return list(ids)


def check_messages(messages) -> list[dict]:
    """The conversation with each message's content as one string, or ValueError naming the message and field.

    A message is a dict with a non-empty string `role` and a `content` that is a string or a list of OpenAI text
    parts ([{"type": "text", "text": ...}], joined with newlines, as vLLM does). Content may be missing or None
    only in an assistant message that carries tool_calls. Other keys (name, tool_call_id, ...) pass through.
    """
    if not isinstance(messages, list | tuple):
        fail("messages", "a list of {role, content} messages", messages, wrong_type=True)
    if not messages:
        fail("messages", "a non-empty list of {role, content} messages", messages)
    checked = []
    for i, message in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(message, dict):
            fail(field, "a {role, content} object", message, wrong_type=True)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            fail(f"{field}.role", "a non-empty string", role, wrong_type=not isinstance(role, str))
        check_text(f"{field}.role", role)
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            checked.append(dict(message))
            continue
        checked.append({**message, "content": _content_text(f"{field}.content", content)})
    return checked


def _content_text(field: str, content) -> str:
    if isinstance(content, str):
        return check_text(field, content, allow_empty=True)
    if not isinstance(content, list | tuple):
        fail(field, "a string or a list of text parts", content, wrong_type=True)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            fail(f"{field}[{j}]", 'a content part {"type": "text", "text": ...}', part, wrong_type=True)
        if part.get("type") != "text":
            fail(f"{field}[{j}].type", "'text' (jaxpage serves text-only models)", part.get("type"))
        texts.append(check_text(f"{field}[{j}].text", part.get("text"), allow_empty=True))
    return "\n".join(texts)


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    stat = path.resolve().stat()
    source = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:builder-{GGUF_TOKENIZER_BUILDER_VERSION}"
    cached = cache_dir() / "gguf-tokenizers" / hashlib.sha256(source.encode()).hexdigest()[:20]
    if cached.is_dir():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(cached))
    tokenizer = load_gguf_tokenizer(path)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, cached)  # atomic: a reader never sees half a tokenizer
            os.mkdir(tmp)  # for TemporaryDirectory's clean-up
    except OSError:
        pass  # a read-only or full cache costs only speed
    return tokenizer


def backend_tokenizer(tokenizer: PreTrainedTokenizerBase):
    """The tokenizers library's Tokenizer whose decode is exactly transformers' decode of `tokenizer` (a fast
    tokenizer that cleans up no tokenization spaces and does not override decoding), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", False) and not (
        type(backend.model).__name__ == "BPE"  # transformers skips the clean-up of a BPE tokenizer's text
        and not getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    )
    from transformers import PreTrainedTokenizerFast  # imported already: the tokenizer is transformers'

    plain = all(getattr(type(tokenizer), f, None) is getattr(PreTrainedTokenizerFast, f) for f in ("decode", "_decode"))
    return backend if plain and not cleans_up else None


class IncrementalDetokenizer:
    """Text of a growing list of output tokens, one token at a time, correct across multi-byte characters, at a cost
    of O(new tokens) a token.

    A byte-level token may end in the middle of a UTF-8 character; its text is held back until the tokens that
    complete it arrive. The last few prompt tokens are decoded along as context, so tokenizers that drop a leading
    space when decoding a lone token still get it right. Where the tokenizer has one (backend_tokenizer), the
    tokenizers library's DecodeStream does the work (under a microsecond a token; a stream its own checks find out
    of step, which only a soup of partial characters makes, starts afresh from the token, as vLLM's does); else each
    token decodes the few tokens since the last complete character, with and without it, through tokenizer.decode.
    """

    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool):
        context = list(prompt_token_ids[-self.CONTEXT_TOKENS :])
        self._skip_special = skip_special_tokens
        self._backend = backend_tokenizer(tokenizer)
        self.text = ""
        self.num_tokens = 0  # tokens added
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._new_stream = DecodeStream
            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
            return
        self._tokenizer = tokenizer
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Appends a token; returns the text it completes (possibly empty)."""
        if self._backend is None:
            self.num_tokens += 1
            return self._add_decoding(token_id)
        try:  # (_stream_step's, inline: once a token)
            delta = self._stream.step(self._backend, token_id)
        except Exception as e:
            delta = self._afresh(e, token_id)
        self.num_tokens += 1
        if not delta:
            return ""
        self.text += delta
        return delta

    def extend(self, token_ids: list[int]) -> str:
        """Appends tokens, as many `add` calls would (with DecodeStream in one call, a fifth of the cost a token);
        returns the text they complete."""
        if self._backend is None or not token_ids:
            return "".join([self.add(token) for token in token_ids])
        return self._stream_step(list(token_ids), len(token_ids))

    def _stream_step(self, ids: int | list[int], count: int) -> str:
        """DecodeStream.step over `count` tokens `ids`; a stream out of step starts afresh before them."""
        try:
            delta = self._stream.step(self._backend, ids)
        except Exception as e:
            delta = self._afresh(e, ids)
        self.num_tokens += count
        if not delta:
            return ""
        self.text += delta
        return delta

    def _afresh(self, error: Exception, ids: int | list[int]) -> str | None:
        """After DecodeStream.step raised `error`: a stream out of step starts afresh at `ids` (its delta); any other
        error is raised again."""
        if not str(error).startswith("Invalid prefix"):
            raise error
        self._stream = self._new_stream(skip_special_tokens=self._skip_special)
        return self._stream.step(self._backend, ids)

    def _add_decoding(self, token_id: int) -> str:
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
