"""A prompt's token ids: text tokenized, or token ids checked (the generate and pooling engines' inputs)."""

from __future__ import annotations

import numpy as np

from jaxpage.validation import ArgumentTypeError, check_text, describe, fail, is_int


def prompt_tokens(prompt, tokenizer, vocab_size: int, prefix: str = "") -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt: a string, or a dict of `prompt` (text) and/or `prompt_token_ids`; a text
    is tokenized by `tokenizer` (None: skip_tokenizer_init) after `prefix` (a pooling model's instruction). ValueError
    naming what is wrong with it; token ids must lie in [0, vocab_size)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty (got '')")
        check_text("prompt", prompt)
        if tokenizer is None:
            raise ValueError(
                "a text prompt needs the tokenizer, which skip_tokenizer_init leaves out: pass "
                "{'prompt_token_ids': [...]}"
            )
        try:
            ids = list(tokenizer(prefix + prompt).input_ids)
        except Exception as e:  # the tokenizer's own failure on this text: refuse the prompt, keep serving
            raise ValueError(f"prompt {describe(prompt)} cannot be tokenized ({type(e).__name__}: {e})") from None
        if not ids:
            fail("prompt", "text with at least one token", prompt)
        if max(ids) >= vocab_size:
            raise ValueError(
                f"the tokenizer gives token id {max(ids)}, outside the model's vocabulary of "
                f"{vocab_size}: the tokenizer does not belong to this model"
            )
        return prompt, ids
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown:
            fail("prompt", "a dict with the keys prompt and/or prompt_token_ids only", sorted(unknown))
        if "prompt_token_ids" in prompt:
            ids = token_ids(prompt["prompt_token_ids"], vocab_size)
            text = prompt.get("prompt")
            if text is not None:
                check_text("prompt", text, allow_empty=True)
            return text, ids
        if "prompt" in prompt:
            return prompt_tokens(check_text("prompt", prompt["prompt"]), tokenizer, vocab_size, prefix)
    fail("prompt", "a string or a dict with prompt_token_ids or prompt", prompt, wrong_type=True)


def token_ids(ids, vocab_size: int) -> list[int]:
    """prompt_token_ids checked: a non-empty list of ints in [0, vocab_size)."""
    vocab = vocab_size
    if not isinstance(ids, list | tuple | np.ndarray) or isinstance(ids, np.ndarray) and ids.ndim != 1:
        fail("prompt_token_ids", "a non-empty list of token ids", ids, wrong_type=True)
    if len(ids) == 0:
        fail("prompt_token_ids", "a non-empty list of token ids", ids)
    bad = [t for t in ids if not is_int(t) or not 0 <= t < vocab][:1]  # a list: the bad id may be None
    if bad:
        raise (ArgumentTypeError if not is_int(bad[0]) else ValueError)(
            f"prompt_token_ids holds {describe(bad[0])}, not a token id in [0, {vocab})"
        )
    return [int(t) for t in ids]
