"""A pooling model's steps: whole inputs packed into the rows of one token axis.

A pooling request is one forward pass over its input (no decoding, no KV cache), so a step is a set of whole inputs.
Its token axis is `num_rows` rows of `row_length` tokens (both powers of two; row_length the smallest, from
MIN_ROW_LENGTH, that holds the step's longest input). Each input lies whole in one row; shorter ones share a row, end
to end; the only padding is at the ends of rows. Attention runs within each row (jaxpage.models.attention:
PackedAttention over a PackedBatch of this row_length), so it costs a token row_length, not the step's whole token
count: the projections and MLPs run over every row's tokens as one matrix, the attention over each row.

`WaitingInputs.take` picks a step: the longest waiting input sets the row length, the oldest goes first (none waits
forever), then the longest waiting input that fits a row, into the first row with room (first-fit decreasing), until
the rows or the step's input slots are full or no waiting input fits. Long inputs set the rows and short ones fill
what they leave: over 10,000 inputs of 8-512 tokens (log-uniform), 0.1-0.4% of the steps' tokens are padding, against
9-13% where the oldest input set the row length (its own and shorter ones in rows of its length: the short ones ran
out first, and the long ones then ran alone). `pack` lays a step out as the arrays the device step reads. A step of
`row_length` L has L * 2^k tokens; each (tokens, row length) is one program.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

import numpy as np

MIN_ROW_LENGTH = 16

Item = TypeVar("Item")


def power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def row_length_for(num_tokens: int) -> int:
    """The row length of a step whose longest input has num_tokens tokens."""
    return max(MIN_ROW_LENGTH, power_of_two_at_least(num_tokens))


def max_step_tokens(max_num_batched_tokens: int, max_model_len: int) -> int:
    """The most tokens a step has: a power of two that every row length of an input of max_model_len divides."""
    return power_of_two_at_least(max(max_num_batched_tokens, max_model_len, MIN_ROW_LENGTH))


def input_slots(num_tokens: int, row_length: int, max_num_seqs: int) -> int:
    """The inputs a step of num_tokens tokens in rows of row_length has room for: max_num_seqs, or four a row where
    that is more (short inputs share rows), at most one a token."""
    return min(num_tokens, max(max_num_seqs, 4 * (num_tokens // row_length)))


def step_shapes(max_tokens: int, max_model_len: int) -> list[tuple[int, int]]:
    """Every (row length, tokens) a step may have: row lengths up to the one of max_model_len, tokens from one row
    to max_tokens (each a program)."""
    shapes, row_length = [], MIN_ROW_LENGTH
    while row_length <= row_length_for(max_model_len):
        shapes += [(row_length, row_length << k) for k in range((max_tokens // row_length).bit_length())]
        row_length *= 2
    return shapes


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What WaitingInputs.take chose: the row of each of the step's inputs (in the order it gives them)."""

    rows: list[int]
    row_length: int
    num_rows: int  # a power of two: the rows the step's token axis has

    @property
    def num_tokens(self) -> int:
        return self.num_rows * self.row_length


class WaitingInputs(Generic[Item]):
    """The inputs waiting for a step, by token count (each at most the row length of the steps' max_tokens, which the
    engine checks before it adds them): `take` picks a step in time logarithmic in the inputs waiting."""

    def __init__(self):
        self._by_length: dict[int, collections.deque[tuple[int, Item]]] = {}  # (arrival, input), oldest first
        self._lengths: list[int] = []  # the token counts some input waits with, ascending
        self._arrivals: collections.deque[tuple[int, int]] = collections.deque()  # (arrival, length), oldest first
        self._gone: set[int] = set()  # arrivals taken or removed that _arrivals still holds
        self._next_arrival = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Item]:
        return (item for queue in self._by_length.values() for _, item in queue)

    def add(self, item: Item, length: int) -> None:
        queue = self._by_length.get(length)
        if queue is None:
            queue = self._by_length[length] = collections.deque()
            bisect.insort(self._lengths, length)
        queue.append((self._next_arrival, item))
        self._arrivals.append((self._next_arrival, length))
        self._next_arrival += 1
        self._count += 1

    def remove(self, drop: Callable[[Item], bool]) -> None:
        """Removes the inputs `drop` is true of."""
        for length in list(self._by_length):
            kept = collections.deque()
            for arrival, item in self._by_length[length]:
                if drop(item):
                    self._gone.add(arrival)
                    self._count -= 1
                else:
                    kept.append((arrival, item))
            self._by_length[length] = kept
            if not kept:
                self._forget(length)

    def take(self, max_tokens: int, max_num_seqs: int) -> tuple[list[Item], StepPlan]:
        """The next step's inputs (at least one; see the module docstring) and their rows; they leave the queue."""
        while self._arrivals[0][0] in self._gone:
            self._gone.discard(self._arrivals.popleft()[0])
        oldest_length = self._arrivals[0][1]
        row_length = row_length_for(self._lengths[-1])
        assert row_length <= max_tokens, (self._lengths[-1], max_tokens)
        max_rows = max_tokens // row_length
        slots = input_slots(max_tokens, row_length, max_num_seqs)
        items, rows, room = [], [], []  # room: each open row's free tokens
        length = oldest_length
        while True:
            row = next((r for r, free in enumerate(room) if free >= length), len(room))
            if row == len(room):
                room.append(row_length)
            room[row] -= length
            rows.append(row)
            items.append(self._pop(length))
            most_room = row_length if len(room) < max_rows else max(room)
            fits = bisect.bisect_right(self._lengths, most_room)
            if len(items) == slots or not fits:
                return items, StepPlan(rows, row_length, power_of_two_at_least(len(room)))
            length = self._lengths[fits - 1]  # the longest that fits (first-fit decreasing)

    def _pop(self, length: int) -> Item:
        queue = self._by_length[length]
        arrival, item = queue.popleft()
        self._gone.add(arrival)
        self._count -= 1
        if not queue:
            self._forget(length)
        return item

    def _forget(self, length: int) -> None:
        del self._by_length[length]
        del self._lengths[bisect.bisect_left(self._lengths, length)]


@dataclasses.dataclass(frozen=True)
class PackedStep:
    """One step's arrays; input i of the step is tokens [starts[i], starts[i] + lengths[i]), all in one row."""

    token_ids: np.ndarray  # [tokens] int32, 0 on padding
    token_type_ids: np.ndarray  # [tokens] int32: BERT's segment of a text pair (0 first, 1 second), else 0
    positions: np.ndarray  # [tokens] int32, each token's position in its input
    segment_ids: np.ndarray  # [tokens] int32, the input (of the step) of each token; -1 on padding
    starts: np.ndarray  # [slots] int32
    lengths: np.ndarray  # [slots] int32, 0 on padding slots
    num_inputs: int
    row_length: int  # tokens a row; tokens = rows * row_length

    @property
    def num_tokens(self) -> int:
        """Tokens of the step's inputs (the rest of the token axis is padding)."""
        return int(self.lengths.sum())


def pack(
    inputs: Sequence[Sequence[int]],
    plan: StepPlan,
    max_num_seqs: int,
    token_types: Sequence[Sequence[int] | None] | None = None,
) -> PackedStep:
    """The step of `inputs` (token id lists, as WaitingInputs.take gave them) laid out in the plan's rows;
    token_types: each input's token type ids, or None for zeros."""
    size, row_length = plan.num_tokens, plan.row_length
    slots = input_slots(size, row_length, max_num_seqs)
    assert len(inputs) == len(plan.rows) <= slots, (len(inputs), len(plan.rows), slots)
    lengths = np.fromiter((len(tokens) for tokens in inputs), np.int32, len(inputs))
    ends = [row * row_length for row in range(plan.num_rows)]  # each row's next free token
    starts = np.zeros(slots, np.int32)
    for i, (row, length) in enumerate(zip(plan.rows, lengths, strict=True)):
        starts[i], ends[row] = ends[row], ends[row] + length
    token_ids, token_type_ids = np.zeros(size, np.int32), np.zeros(size, np.int32)
    positions, segment_ids = np.zeros(size, np.int32), np.full(size, -1, np.int32)
    types = token_types if token_types is not None else [None] * len(inputs)
    for i, (tokens, kinds) in enumerate(zip(inputs, types, strict=True)):
        place = slice(starts[i], starts[i] + lengths[i])
        token_ids[place], segment_ids[place], positions[place] = tokens, i, np.arange(lengths[i])
        if kinds is not None:
            token_type_ids[place] = kinds
    padded_lengths = np.zeros(slots, np.int32)
    padded_lengths[: len(inputs)] = lengths
    return PackedStep(
        token_ids, token_type_ids, positions, segment_ids, starts, padded_lengths, len(inputs), row_length
    )
