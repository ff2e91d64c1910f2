"""StepStats from a step's plan and results, host only: the query-key pairs a step's attention computes."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from jaxpage.engine.step_stats import StepStats, attended_keys_of
from jaxpage.worker.step_shapes import StepShape


def decode(computed: int) -> SimpleNamespace:
    """A sequence with `computed` tokens in the pool and one new token."""
    return SimpleNamespace(num_computed_tokens=computed, num_new_tokens=1, draft_token_ids=[])


def stats(items: list, model) -> StepStats:
    step = SimpleNamespace(scheduled=items, num_batched_tokens=len(items), num_sampled=len(items))
    result = SimpleNamespace(shape=StepShape(2, 2, 8, 1), prepare_s=0.0, device_s=0.0)
    return StepStats([step], [result], [], 0.0, 0.0, model)


def model(layers: int, window: int | None, sliding: tuple[bool, ...]):
    return SimpleNamespace(num_layers=layers, sliding_window=window, sliding_layers=sliding)


def test_attended_keys_within_a_window():
    computed, counts = np.array([2]), np.array([3])  # tokens 3, 4, 5 see 3, 4, 5 keys
    assert attended_keys_of(computed, counts, None).tolist() == [3 + 4 + 5]
    assert attended_keys_of(computed, counts, 4).tolist() == [3 + 4 + 4]
    # Every case against the sum token by token: before the window, across its start, past it
    cases = list(itertools.product(range(40), range(1, 20)))
    computed, counts = (np.array(column) for column in zip(*cases, strict=True))
    for window in (None, 1, 5, 16):
        expected = [sum(min(c + i + 1, window or c + i + 1) for i in range(q)) for c, q in cases]
        assert attended_keys_of(computed, counts, window).tolist() == expected


@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        (model(4, None, (False,) * 4), 11 + 21),  # every layer sees every key
        (model(4, 4, (True,) * 4), 4 + 4),  # Mistral: every layer slides
        (model(4, 4, (True, True, True, False)), (3 * 4 + 11 + 3 * 4 + 21) / 4),  # Gemma 3: 3 of 4 layers slide
    ],
    ids=["full", "all-sliding", "hybrid"],
)
def test_a_step_counts_each_layers_keys_and_gives_their_mean(layers, expected):
    assert stats([decode(10), decode(20)], layers).num_attended_keys == expected
