"""A pooling model's steps: inputs packed end to end into one token axis, no padding between them.

A pooling request is one forward pass over its input (no decoding, no KV cache), so a step is a set of whole inputs.
`take` picks them: the oldest waiting input first (so none waits forever), then every later one that still fits the
step's token budget and rows. `pack` lays them out as the arrays the device step reads; the step's token count is
padded at the end only, up to the smallest of a few sizes (`token_buckets`: powers of two), and its rows (inputs) to
`rows_for(tokens)`, so a model compiles one program per token bucket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

MIN_TOKEN_BUCKET = 16


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """The step sizes in tokens: powers of two from MIN_TOKEN_BUCKET below max_tokens, and max_tokens."""
    sizes, size = [], MIN_TOKEN_BUCKET
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return (*sizes, max_tokens)


def rows_for(num_tokens: int, max_rows: int) -> int:
    """The rows (inputs) a step of num_tokens tokens has room for: each input has a token at least."""
    return min(num_tokens, max_rows)


def take(lengths: Sequence[int], max_tokens: int, max_rows: int) -> list[int]:
    """Indices into `lengths` (waiting inputs' token counts, oldest first) of the inputs the next step runs: the
    first, then each later one that fits what is left of max_tokens, up to max_rows inputs. Every length must be at
    most max_tokens (the engine refuses longer inputs when they are added)."""
    chosen, budget = [], max_tokens
    for index, length in enumerate(lengths):
        assert 0 < length <= max_tokens, (length, max_tokens)
        if length <= budget:
            chosen.append(index)
            budget -= length
            if len(chosen) == max_rows or budget == 0:
                break
    return chosen


@dataclasses.dataclass(frozen=True)
class PackedStep:
    """One step's arrays; input i of the step is tokens [starts[i], starts[i] + lengths[i])."""

    token_ids: np.ndarray  # [tokens] int32, 0 on padding
    token_type_ids: np.ndarray  # [tokens] int32: BERT's segment of a text pair (0 first, 1 second), else 0
    positions: np.ndarray  # [tokens] int32, each token's position in its input
    segment_ids: np.ndarray  # [tokens] int32, the input (row) of each token; -1 on padding
    starts: np.ndarray  # [rows] int32
    lengths: np.ndarray  # [rows] int32, 0 on padding rows
    num_inputs: int

    @property
    def num_tokens(self) -> int:
        """Tokens of the step's inputs (the rest of the token axis is padding)."""
        return int(self.lengths.sum())


def pack(
    inputs: Sequence[Sequence[int]],
    buckets: Sequence[int],
    max_rows: int,
    token_types: Sequence[Sequence[int] | None] | None = None,
) -> PackedStep:
    """The step of `inputs` (token id lists, in order), its token axis the smallest bucket that holds them all;
    token_types: each input's token type ids, or None for zeros."""
    lengths = np.fromiter((len(tokens) for tokens in inputs), np.int32, len(inputs))
    total = int(lengths.sum())
    size = next(bucket for bucket in buckets if bucket >= total)
    rows = rows_for(size, max_rows)
    assert len(inputs) <= rows, (len(inputs), rows)
    token_ids = np.zeros(size, np.int32)
    token_ids[:total] = np.fromiter((t for tokens in inputs for t in tokens), np.int32, total)
    token_type_ids = np.zeros(size, np.int32)
    if token_types is not None and any(types is not None for types in token_types):
        types = (t for tokens, kinds in zip(inputs, token_types, strict=True) for t in (kinds or [0] * len(tokens)))
        token_type_ids[:total] = np.fromiter(types, np.int32, total)
    starts = np.zeros(rows, np.int32)
    starts[: len(inputs)] = np.cumsum(lengths) - lengths
    segment_ids = np.full(size, -1, np.int32)
    segment_ids[:total] = np.repeat(np.arange(len(inputs), dtype=np.int32), lengths)
    positions = np.zeros(size, np.int32)
    positions[:total] = np.arange(total, dtype=np.int32) - np.repeat(starts[: len(inputs)], lengths)
    padded_lengths = np.zeros(rows, np.int32)
    padded_lengths[: len(inputs)] = lengths
    return PackedStep(token_ids, token_type_ids, positions, segment_ids, starts, padded_lengths, len(inputs))
