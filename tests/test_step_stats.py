"""StepStats from a step's plan and results, host only: the query-key pairs a step's attention computes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxpage.engine.step_stats import StepStats, attended_keys


def decode(computed: int) -> SimpleNamespace:
    """A sequence with `computed` tokens in the pool and one new token."""
    return SimpleNamespace(num_computed_tokens=computed, num_new_tokens=1, draft_token_ids=[])


def stats(items: list, model) -> StepStats:
    step = SimpleNamespace(scheduled=items, num_batched_tokens=len(items))
    result = SimpleNamespace(shape="decode(T=2, S=2, R=8)", prepare_s=0.0, device_s=0.0)
    return StepStats.of([step], [result], [], len(items), 0.0, 0.0, model)


def model(layers: int, window: int | None, sliding: tuple[bool, ...]):
    return SimpleNamespace(num_layers=layers, sliding_window=window, sliding_layers=sliding)


def test_attended_keys_within_a_window():
    chunk = SimpleNamespace(num_computed_tokens=2, num_new_tokens=3)  # tokens 3, 4, 5 see 3, 4, 5 keys
    assert attended_keys(chunk, None) == 3 + 4 + 5
    assert attended_keys(chunk, 4) == 3 + 4 + 4


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
