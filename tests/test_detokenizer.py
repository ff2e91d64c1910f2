"""Incremental detokenization (jaxpage.tokenizers.tokenizer.IncrementalDetokenizer): the tokenizers library's
DecodeStream where the tokenizer has one, else two decodes of the last few tokens a token; both give the text that
decoding the whole output gives."""

from __future__ import annotations

import random

import pytest

from jaxpage.benchmarks.workloads import corpus_text
from jaxpage.tokenizers.tokenizer import IncrementalDetokenizer, backend_tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path)


class WithoutBackend:
    """The tokenizer without its backend: IncrementalDetokenizer then decodes through tokenizer.decode."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


def texts(tokenizer, count: int = 40) -> list[list[int]]:
    rng, corpus = random.Random(0), corpus_text()
    special = list(tokenizer.all_special_ids)
    outputs = []
    for _ in range(count):
        start = rng.randrange(len(corpus) - 300)
        ids = tokenizer(corpus[start : start + 200] + " Zoë 東京は晴れ 🙂🙃", add_special_tokens=False).input_ids
        # A special token between two characters (inside one, no incremental text can show the character's bytes)
        cut = rng.choice([i for i in range(1, len(ids)) if not tokenizer.decode(ids[:i]).endswith("\ufffd")])
        ids.insert(cut, rng.choice(special))
        outputs.append(ids)
    return outputs


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_decode_stream_and_the_decodes_give_the_whole_output_s_text(tokenizer, skip_special_tokens):
    assert backend_tokenizer(tokenizer) is not None  # the default model's tokenizer streams
    for ids in texts(tokenizer):
        prompt = ids[:3]
        expected = tokenizer.decode(ids[3:], skip_special_tokens=skip_special_tokens)
        for detokenizer in (
            IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens),
            IncrementalDetokenizer(WithoutBackend(tokenizer), prompt, skip_special_tokens),
        ):
            deltas = [detokenizer.add(token) for token in ids[3:]]
            assert "".join(deltas) == detokenizer.text == expected


def test_a_soup_of_partial_characters_never_fails_the_stream(tokenizer):
    """Random tokens (what a random model samples) can put DecodeStream out of step; it starts afresh, as vLLM's."""
    rng = random.Random(1)
    byte_pieces = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
    assert byte_pieces  # tokens that are part of a character
    for _ in range(200):
        ids = [rng.choice(byte_pieces) if rng.random() < 0.6 else rng.randrange(len(tokenizer)) for _ in range(30)]
        detokenizer = IncrementalDetokenizer(tokenizer, ids[:2], True)
        text = "".join(detokenizer.add(token) for token in ids[2:])
        assert isinstance(text, str) and text == detokenizer.text
