"""Speculative decoding counters: what each draft adds, the derived rates, merging."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxpage.spec_decode.stats import SpecDecodingStats


def test_counts_and_rates_by_hand():
    stats = SpecDecodingStats(num_spec_tokens=3)
    assert stats.acceptance_rate is None and stats.mean_accepted_length is None
    stats.observe_draft(3, 2)
    stats.observe_draft(3, 0)
    stats.observe_draft(1, 1)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 7, 3)
    assert stats.num_accepted_tokens_per_pos == [2, 1, 0]
    assert stats.acceptance_rate == 3 / 7 and stats.mean_accepted_length == 2.0
    assert stats.acceptance_per_position == [2 / 3, 1 / 3, 0.0]
    assert stats.as_dict()["mean_accepted_length"] == 2.0


@given(
    st.integers(1, 6).flatmap(
        lambda k: st.tuples(st.just(k), st.lists(st.tuples(st.integers(1, k), st.floats(0, 1)), max_size=30))
    )
)
def test_per_position_counts_add_up_and_never_grow_with_position(case):
    k, drafts = case
    whole, first, second = SpecDecodingStats(k), SpecDecodingStats(k), SpecDecodingStats(k)
    for i, (num_draft, fraction) in enumerate(drafts):
        accepted = int(fraction * num_draft)
        whole.observe_draft(num_draft, accepted)
        (first if i % 2 else second).observe_draft(num_draft, accepted)
    first.merge(second)
    assert first == whole
    per_pos = whole.num_accepted_tokens_per_pos
    assert sum(per_pos) == whole.num_accepted_tokens <= whole.num_draft_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
    assert all(count <= whole.num_drafts for count in per_pos)


def test_counts_since_a_copy():
    stats = SpecDecodingStats(num_spec_tokens=3)
    stats.observe_draft(3, 2)
    before = stats.copy()
    stats.observe_draft(2, 1)
    stats.observe_draft(3, 3)
    later = SpecDecodingStats(num_spec_tokens=3)
    later.observe_draft(2, 1)
    later.observe_draft(3, 3)
    assert stats.since(before) == later
    assert before.num_drafts == 1  # the copy kept its counts


def test_impossible_observations_are_refused():
    stats = SpecDecodingStats(num_spec_tokens=2)
    for num_draft, accepted in [(0, 0), (3, 1), (2, 3), (2, -1)]:
        with pytest.raises(ValueError, match="cannot keep"):
            stats.observe_draft(num_draft, accepted)
    with pytest.raises(ValueError, match="cannot merge"):
        stats.merge(SpecDecodingStats(num_spec_tokens=3))
    assert stats == SpecDecodingStats(num_spec_tokens=2)
