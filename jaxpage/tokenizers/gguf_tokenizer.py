"""A GGUF file's tokenizer, built from the file's metadata (read by `jaxpage.models.gguf_file`) with `tokenizers` alone.

transformers builds the same tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), but its GGUF reader
imports torch, which jaxpage must not need at run time. This module reads llama.cpp's `tokenizer.*` keys itself and
assembles a `tokenizers.Tokenizer` equal to transformers' conversion (vocabulary, merges, pre-tokenizer, decoder,
added tokens, BOS/EOS post-processor), wrapped in `PreTrainedTokenizerFast` with the special tokens and chat
template, so it behaves the same on transformers 4.5x and 5.x. One departure: a default special token of
transformers' tokenizer classes that the vocabulary lacks (<|endoftext|> in a Llama 3 file) is not added, since it
would get an id past the model's embedding table; like llama.cpp, jaxpage reads it as text.

Two tokenizer models are read (`tokenizer.ggml.model`):
  "gpt2"   byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM, ...): the text is split by the regex that
           `tokenizer.ggml.pre` names, its bytes spelled in GPT-2's byte alphabet, then merged.
  "llama"  SentencePiece-style BPE with byte fallback (Llama 2, Mistral): "▁" marks spaces; merges come from
           `tokenizer.ggml.merges`, or from the vocabulary ordered by `tokenizer.ggml.scores`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from jaxpage.errors import ModelLoadError

if TYPE_CHECKING:  # transformers takes most of a second to import: build_tokenizer imports it
    from transformers import PreTrainedTokenizerFast
from jaxpage.models.gguf_file import read_gguf

# Bump when what `load_gguf_tokenizer` builds changes: tokenizers cached from an older builder are then not reused.
GGUF_TOKENIZER_BUILDER_VERSION = 1

# llama.cpp's token types (`tokenizer.ggml.token_type`); CONTROL and USER_DEFINED become added tokens.
NORMAL = 1
CONTROL = 3  # <|im_start|>, <s>: special added tokens (dropped by skip_special_tokens)
USER_DEFINED = 4  # <think>: plain added tokens, always matched whole in the text

# The special tokens transformers' GPT2Tokenizer and LlamaTokenizer make special by default, which its GGUF
# conversion keeps whatever the file's token types say.
DEFAULT_SPECIAL_TOKENS = {"gpt2": ("<|endoftext|>",), "llama": ("<unk>", "<s>", "</s>")}

# Named special tokens, from their id fields.
SPECIAL_TOKEN_FIELDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}

# SentencePiece vocabularies of these architectures need builders of their own (transformers has them); jaxpage
# loads none of these models.
UNSUPPORTED_SENTENCEPIECE_ARCHITECTURES = ("gemma", "gemma2", "gemma3", "phi3")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> the regex that splits text before byte-level BPE, as transformers' GGUF conversion maps
# it. Any other name (smollm, gpt-2, default, starcoder, ...) keeps GPT-2's own split (`ByteLevel(use_regex=True)`).
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


@dataclasses.dataclass(frozen=True)
class GgufVocab:
    """The tokenizer metadata of a GGUF file (llama.cpp's `tokenizer.*` keys), checked."""

    path: Path
    architecture: str | None
    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    pre: str | None  # tokenizer.ggml.pre
    tokens: list[str]  # [vocab]
    token_types: list[int]  # [vocab], NORMAL where the file has none
    scores: list[float] | None  # [vocab]
    merges: list[tuple[str, str]] | None
    special_ids: dict[str, int]  # "bos_token" -> id, for the ids the file gives
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def load_gguf_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """The tokenizer a GGUF file describes (with its special tokens and chat template), without torch.

    Raises ModelLoadError, naming the file and the field, for a tokenizer type other than "gpt2" or "llama" or for
    malformed metadata.
    """
    return build_tokenizer(read_gguf_vocab(path))


def read_gguf_vocab(path: str | os.PathLike) -> GgufVocab:
    """The tokenizer metadata of a GGUF file. ModelLoadError naming the file and the field when it is malformed."""
    path = Path(path)
    field = _FieldReader(path, read_gguf(path).metadata)

    model = field.get("tokenizer.ggml.model", str)
    if model is None:
        raise ModelLoadError(f"{path}: metadata tokenizer.ggml.model is missing: the file describes no tokenizer")
    if model not in DEFAULT_SPECIAL_TOKENS:
        raise ModelLoadError(
            f"{path}: tokenizer.ggml.model is {model!r}, which jaxpage does not build; it builds 'gpt2' (byte-level "
            "BPE) and 'llama' (SentencePiece BPE) tokenizers"
        )
    architecture = field.get("general.architecture", str)
    if model == "llama" and architecture in UNSUPPORTED_SENTENCEPIECE_ARCHITECTURES:
        raise ModelLoadError(f"{path}: the SentencePiece tokenizer of architecture {architecture!r} is not supported")

    tokens = field.get("tokenizer.ggml.tokens", list, str)
    if not tokens:
        raise ModelLoadError(f"{path}: metadata tokenizer.ggml.tokens is missing or empty")
    token_types = field.get("tokenizer.ggml.token_type", list, int, length=len(tokens))
    scores = field.get("tokenizer.ggml.scores", list, (int, float), length=len(tokens))
    merges = field.get("tokenizer.ggml.merges", list, str)
    if merges is not None:
        if bad := next((merge for merge in merges if merge.count(" ") != 1), None):
            raise ModelLoadError(f"{path}: tokenizer.ggml.merges holds {bad!r}, not two tokens joined by a space")
        merges = [tuple(merge.split(" ")) for merge in merges]
    elif model == "llama" and scores is None:
        raise ModelLoadError(
            f"{path}: metadata tokenizer.ggml.scores is missing; a 'llama' tokenizer without tokenizer.ggml.merges "
            "needs it to order its merges"
        )

    special_ids = {}
    for name, key in SPECIAL_TOKEN_FIELDS.items():
        token_id = field.get(key, int)
        if token_id is not None:
            if not 0 <= token_id < len(tokens):
                raise ModelLoadError(f"{path}: {key} is {token_id}, outside the vocabulary of {len(tokens)} tokens")
            special_ids[name] = token_id

    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise, and transformers follows it.
    add_bos = field.get("tokenizer.ggml.add_bos_token", bool)
    return GgufVocab(
        path=path,
        architecture=architecture,
        model=model,
        pre=field.get("tokenizer.ggml.pre", str),
        tokens=tokens,
        token_types=token_types or [NORMAL] * len(tokens),
        scores=scores,
        merges=merges,
        special_ids=special_ids,
        add_bos=add_bos if add_bos is not None else model == "llama",
        add_eos=bool(field.get("tokenizer.ggml.add_eos_token", bool)),
        chat_template=field.get("tokenizer.chat_template", str),
    )


def build_tokenizer(vocab: GgufVocab) -> PreTrainedTokenizerFast:
    """The tokenizer that `vocab` describes, as transformers' GGUF conversion builds it."""
    from transformers import PreTrainedTokenizerFast

    spell = spell_byte_level if vocab.model == "gpt2" else str
    token_ids = {spell(token): index for index, token in enumerate(vocab.tokens)}  # a repeated token: its last id
    try:
        if vocab.model == "gpt2":
            tokenizer = Tokenizer(
                models.BPE(
                    vocab=token_ids,
                    merges=vocab.merges or [],
                    dropout=None,
                    continuing_subword_prefix="",
                    end_of_word_suffix="",
                    fuse_unk=False,
                )
            )
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tokenizer.decoder = decoders.ByteLevel()
        else:
            merges = vocab.merges if vocab.merges is not None else merges_from_scores(vocab.tokens, vocab.scores)
            tokenizer = Tokenizer(
                models.BPE(vocab=token_ids, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None)
            )
            tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement="\u2581", prepend_scheme="first", split=False
            )
            tokenizer.decoder = decoders.Sequence(
                [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
            )
    except Exception as e:  # tokenizers raises a bare Exception, e.g. for a merge of tokens not in the vocabulary
        raise ModelLoadError(f"{vocab.path}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens ({e})") from None
    if vocab.pre in PRE_TOKENIZER_SPLITS:  # transformers splits by this name whatever the model, and so do we
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[vocab.pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    # Added tokens are matched whole in the text before the pre-tokenizer runs. A byte-level control token spelled
    # outside the byte alphabet is a mislabel and stays a plain token. Defaults the vocabulary lacks are not added:
    # transformers gives them ids past the model's embedding table.
    kinds = list(zip(vocab.tokens, vocab.token_types, strict=True))
    defaults = [token for token in DEFAULT_SPECIAL_TOKENS[vocab.model] if token in token_ids]
    control = [token for token, kind in kinds if kind == CONTROL and spell(token) == token]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in defaults + control])
    user_defined = [token for token, kind in kinds if kind == USER_DEFINED and token in token_ids]  # as spelled
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])
    named = {name: spell(vocab.tokens[token_id]) for name, token_id in vocab.special_ids.items()}
    added = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    tokenizer.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in named.values() if t not in added]
    )

    bos = named.get("bos_token") if vocab.add_bos else None
    eos = named.get("eos_token") if vocab.add_eos else None
    try:
        tokenizer.post_processor = bos_eos_processor(tokenizer, bos, eos)
    except Exception as e:  # a token name that a template cannot hold, e.g. one with a colon
        raise ModelLoadError(f"{vocab.path}: BOS {bos!r} / EOS {eos!r} cannot be added to sequences ({e})") from None
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=named.get("bos_token"),
        eos_token=named.get("eos_token"),
        unk_token=named.get("unk_token"),
        pad_token=named.get("pad_token"),
        chat_template=vocab.chat_template,
        add_bos_token=bos is not None,
        add_eos_token=eos is not None,
        clean_up_tokenization_spaces=False,
    )


def _byte_spelling() -> dict[int, str]:
    # GPT-2's map: the printable Latin-1 bytes stand for themselves, the other 68 for U+0100 onwards, in order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


BYTE_SPELLING = _byte_spelling()  # byte -> the character that spells it in byte-level BPE tokens
BYTE_ALPHABET = frozenset(BYTE_SPELLING.values())


def spell_byte_level(token: str) -> str:
    """`token` as a byte-level vocabulary spells it: unchanged when it is in the byte alphabet already (as llama.cpp
    writes byte-level tokens), else its UTF-8 bytes spelled one character each."""
    if set(token) <= BYTE_ALPHABET:
        return token
    return "".join(BYTE_SPELLING[b] for b in token.encode("utf-8"))


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a token into two tokens, best score first.

    Ties keep the vocabulary's order: by token, then by the ids of the two halves (as transformers orders them).
    """
    token_ids = {token: index for index, token in enumerate(tokens)}
    merges = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        halves = [(token[:i], token[i:]) for i in range(1, len(token))]
        halves = sorted(
            ((left, right) for left, right in halves if left in token_ids and right in token_ids),
            key=lambda pair: (token_ids[pair[0]], token_ids[pair[1]]),
        )
        merges.extend((left, right, score) for left, right in halves)
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)  # stable: ties keep order
    return [(left, right) for left, right, _ in merges]


def bos_eos_processor(tokenizer: Tokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    """Adds `bos` before and `eos` after each sequence (either may be None), as transformers' backend does."""
    single = [*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])]
    pair = [*single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])]
    special = [(token, tokenizer.token_to_id(token)) for token in (bos, eos) if token]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


class _FieldReader:
    """Typed access to a GGUF file's metadata fields, with errors that name the file and the field."""

    def __init__(self, path: Path, metadata: dict[str, Any]):
        self._path = path
        self._metadata = metadata

    def get(self, key: str, kind: type, item: type | tuple[type, ...] | None = None, length: int | None = None):
        """The value of field `key` (None when absent), checked to be a `kind` (of `item`s, `length` long)."""
        if key not in self._metadata:
            return None
        value = self._metadata[key]
        if isinstance(value, np.ndarray):  # an array of numbers: checked below as a list, like an array of strings
            value = value.tolist()
        if kind is bool and isinstance(value, (bool, int)) and not isinstance(value, str):
            return bool(value)
        if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
            raise ModelLoadError(f"{self._path}: metadata {key} is a {type(value).__name__}, not a {kind.__name__}")
        if item is not None and not all(isinstance(v, item) and not isinstance(v, bool) for v in value):
            raise ModelLoadError(f"{self._path}: metadata {key} holds values of the wrong type")
        if length is not None and len(value) != length:
            raise ModelLoadError(f"{self._path}: metadata {key} has {len(value)} entries for {length} tokens")
        return value
