"""N-gram prompt lookup against a plain-Python reference, and the drafts it gives on copy-like text."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from jaxpage.spec_decode.ngram import propose_ngram


def reference(tokens: list[int], k: int, low: int, high: int) -> tuple[list[int], int]:
    """The longest n in [low, high] whose last-n-token suffix occurs earlier, its most recent occurrence, and up to
    k tokens after it, with n; written the slow way."""
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):  # occurrences that end before the last token
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k], n
    return [], 0


@given(
    st.lists(st.integers(0, 3), max_size=60),
    st.integers(1, 6),
    st.integers(1, 5),
    st.integers(0, 4),
)
def test_matches_the_reference(tokens, k, low, extra):
    high = low + extra
    assert propose_ngram(tokens, k, low, high) == reference(tokens, k, low, high)


def test_copying_text_drafts_what_follows_the_most_recent_occurrence():
    text = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 3, 4, 5, 6, 7]
    # "5 6 7" occurs at 0 and at 7; the most recent one is followed by 3 4 5.
    assert propose_ngram(text, 3, 2, 3) == ([3, 4, 5], 3)
    assert propose_ngram(text, 10, 2, 3) == ([3, 4, 5, 6, 7], 3)  # fewer when the sequence ends first
    # A longer match wins over a more recent shorter one: "9 7" -> 1 (at 1), "8 9 7" longer -> 2 (at 5).
    assert propose_ngram([8, 9, 7, 2, 9, 7, 1, 3, 8, 9, 7], 1, 1, 3) == ([2], 3)


def test_nothing_is_drafted_without_a_long_enough_match():
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == ([], 0)  # the last token never occurred before
    assert propose_ngram([1, 2, 9, 3, 2], 3, 2, 3) == ([], 0)  # only a 1-gram recurs
    assert propose_ngram([1, 2, 9, 3, 2], 3, 1, 3) == ([9, 3, 2], 1)
    assert propose_ngram([], 3, 1, 3) == ([], 0) and propose_ngram([4], 3, 1, 1) == ([], 0)
