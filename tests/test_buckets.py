"""The step shapes: every step size has a bucket, the largest is the token budget, padding stays bounded."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from jaxpage.model_runner import bucket_for, powers_of_two, token_buckets


@given(st.integers(1, 8192))
def test_token_buckets_cover_every_step_size(budget):
    buckets = token_buckets(budget)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max(budget, 4)
    for n in {1, 2, 3, budget // 3 + 1, budget // 2 + 1, budget}:
        bucket = bucket_for(n, buckets)
        assert bucket >= n
        if n > 4 and bucket <= 128:  # small steps: at most 2x padding, 1.5x between the half steps
            assert bucket < 2 * n


def test_token_buckets_for_the_default_budget():
    assert token_buckets(512) == [4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512]


def test_powers_of_two_end_at_the_maximum():
    assert powers_of_two(4, 64) == [4, 8, 16, 32, 64]
    assert powers_of_two(4, 100) == [4, 8, 16, 32, 64, 100]
