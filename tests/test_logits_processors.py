"""Logits processors: the bitmask layout is llguidance's, and mask + logit_bias + penalties match a plain numpy
re-statement of vLLM's formulas; rows with everything off come out bit-for-bit unchanged."""

from __future__ import annotations

import jax
import llguidance.numpy
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxpage.sample.logits_controls import pack_bitmask
from jaxpage.sample.logits_processors import LogitsInputs, PenaltyInputs, apply_logits_processors, unpack_bitmask

apply_jit = jax.jit(apply_logits_processors)

# Every hypothesis example is padded to these shapes, so the jitted function compiles once for all of them.
ROWS, VOCAB, HISTORY, BIAS_ENTRIES = 4, 61, 16, 6  # 61: the bitmask's last word is partly past the vocabulary


def all_allowed(rows: int, vocab: int) -> np.ndarray:
    return np.full((rows, -(-vocab // 32)), -1, np.int32)


def no_bias(rows: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((rows, 1), np.int32), np.zeros((rows, 1), np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as float32 bit patterns (tells -0.0 from 0.0)."""
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


def reference(
    logits: np.ndarray,  # [N, V] float32
    allowed: np.ndarray,  # [N, V] bool
    bias_ids: np.ndarray,  # [N, B] int
    bias_values: np.ndarray,  # [N, B] float32
    token_ids: np.ndarray | None,  # [N, H] int, -1 padding; None: no penalties
    num_prompt_tokens: np.ndarray | None,  # [N] int
    presence: np.ndarray | None,  # [N] float32
    frequency: np.ndarray | None,  # [N] float32
    repetition: np.ndarray | None,  # [N] float32
) -> np.ndarray:  # [N, V] float32
    """vLLM v1's sampler, re-stated in numpy: allowed tokens, then logit_bias, then `apply_penalties`."""
    logits = np.array(logits, np.float32)
    num_rows, vocab = logits.shape
    logits[~allowed] = -np.inf
    for row in range(num_rows):
        for token, value in zip(bias_ids[row], bias_values[row], strict=True):
            logits[row, token] += value
    if token_ids is None:
        return logits

    prompt_mask = np.zeros((num_rows, vocab), bool)
    output_counts = np.zeros((num_rows, vocab), np.int64)
    for row in range(num_rows):
        for position, token in enumerate(token_ids[row]):
            if token < 0:
                continue
            if position < num_prompt_tokens[row]:
                prompt_mask[row, token] = True
            else:
                output_counts[row, token] += 1
    output_mask = output_counts > 0

    # vLLM's apply_repetition_penalties: divide positive logits, multiply the others.
    penalties = np.where(prompt_mask | output_mask, repetition[:, None], np.float32(1.0)).astype(np.float32)
    positive = logits > 0
    with np.errstate(over="ignore"):  # a tiny penalty may send a logit to inf, as it does in vLLM
        logits[positive] /= penalties[positive]
        logits[~positive] *= penalties[~positive]
    # The OpenAI API's definition.
    logits -= frequency[:, None] * output_counts.astype(np.float32)
    logits -= presence[:, None] * output_mask.astype(np.float32)
    return logits


# --- bitmask ------------------------------------------------------------------------------------------------------


def test_pack_bitmask_layout_by_hand():
    allowed = np.zeros((4, 40), bool)
    allowed[0, 0] = True  # word 0 = 1
    allowed[1, 31] = True  # word 0 = bit 31 = -2**31 as int32
    allowed[2, 32] = True  # word 1 = 1
    allowed[3, [1, 3, 39]] = True  # word 0 = 2 + 8 = 10, word 1 = 2**7 = 128
    expected = np.array([[1, 0], [-(2**31), 0], [0, 1], [10, 128]], np.int32)
    packed = pack_bitmask(allowed)
    assert packed.dtype == np.int32
    np.testing.assert_array_equal(packed, expected)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 37, 100])
def test_pack_unpack_round_trip(vocab):
    allowed = np.random.default_rng(vocab).random((3, vocab)) < 0.5
    packed = pack_bitmask(allowed)
    assert packed.shape == (3, -(-vocab // 32))
    np.testing.assert_array_equal(np.asarray(unpack_bitmask(packed, vocab)), allowed)


def test_unpack_ignores_bits_past_vocab():
    # 37 tokens: word 1 holds tokens 32..36 in its bits 0..4; its other bits are past the vocabulary.
    words = np.array([[-1, -1], [0, ~0b11111], [0, 0b10]], np.int32)
    unpacked = np.asarray(unpack_bitmask(words, 37))
    assert unpacked[0].all()
    assert not unpacked[1].any()
    np.testing.assert_array_equal(np.flatnonzero(unpacked[2]), [33])


@pytest.mark.parametrize("vocab", [37, 100])
def test_bitmask_masks_like_llguidance(vocab):
    rng = np.random.default_rng(vocab)
    rows = 5
    words = rng.integers(-(2**31), 2**31, (rows, -(-vocab // 32)), dtype=np.int64).astype(np.int32)
    words[1] = -1  # everything allowed
    words[2] = 0  # nothing allowed
    words[3, 0] = 1 << 5  # only token 5 among the first 32
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)

    expected = logits.copy()
    llguidance.numpy.apply_token_bitmask_inplace(expected, words)
    ours = apply_jit(logits, LogitsInputs(words, *no_bias(rows), None))
    assert same_bits(ours, expected)


# --- bias and penalties ---------------------------------------------------------------------------------------------


def test_penalties_by_hand():
    logits = np.array([[2.0, -1.0, 0.5, 3.0]], np.float32)
    token_ids = np.array([[0, 1, 1, 2, -1]], np.int32)  # prompt [0], output [1, 1, 2], one padding
    num_prompt_tokens = np.array([1], np.int32)
    presence, frequency, repetition = (np.array([x], np.float32) for x in (0.25, 0.5, 2.0))
    # token 0 (prompt only): 2 / 2 = 1
    # token 1 (output twice): -1 * 2 - 0.5 * 2 - 0.25 = -3.25
    # token 2 (output once): 0.5 / 2 - 0.5 * 1 - 0.25 = -0.5
    # token 3 (unseen): 3
    expected = np.array([[1.0, -3.25, -0.5, 3.0]], np.float32)
    args = (token_ids, num_prompt_tokens, presence, frequency, repetition)
    np.testing.assert_array_equal(reference(logits, np.ones((1, 4), bool), *no_bias(1), *args), expected)
    ours = apply_jit(logits, LogitsInputs(all_allowed(1, 4), *no_bias(1), PenaltyInputs(*args)))
    np.testing.assert_array_equal(np.asarray(ours), expected)


def test_bias_by_hand():
    logits = np.array([[1.0, 1.0, 1.0]], np.float32)
    bias_ids = np.array([[2, 0, 2, 1]], np.int32)  # token 2 twice; the last entry is padding
    bias_values = np.array([[1.5, -3.0, 0.25, 0.0]], np.float32)
    expected = np.array([[1.0 - 3.0, 1.0, 1.0 + 1.5 + 0.25]], np.float32)
    ours = apply_jit(logits, LogitsInputs(all_allowed(1, 3), bias_ids, bias_values, None))
    np.testing.assert_array_equal(np.asarray(ours), expected)


# XLA on CPU flushes subnormal floats to zero (numpy does not), so none are drawn.
def floats(low: float, high: float, **kwargs) -> st.SearchStrategy[float]:
    return st.floats(low, high, width=32, allow_subnormal=False, **kwargs)


penalty_values = st.one_of(st.just(0.0), floats(-2.0, 2.0))
repetition_values = st.one_of(st.just(1.0), floats(0.0, 2.0, exclude_min=True))
logit_values = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0]), floats(-20.0, 20.0))
bias_entry_values = st.one_of(st.just(0.0), floats(-100.0, 100.0))


@st.composite
def batches(draw):
    """A padded batch: `used` rows with random settings, then everything-off rows (random logits and histories)."""
    used = draw(st.integers(1, ROWS))
    token_range = draw(st.sampled_from([2, 5, VOCAB]))  # small ranges make repeated tokens likely
    logits = draw(hnp.arrays(np.float32, (ROWS, VOCAB), elements=logit_values))
    allowed = draw(hnp.arrays(bool, (ROWS, VOCAB), elements=st.sampled_from([True, True, True, False])))
    allowed[used:] = True
    bias_ids = draw(hnp.arrays(np.int32, (ROWS, BIAS_ENTRIES), elements=st.integers(0, VOCAB - 1))) % token_range
    bias_values = draw(hnp.arrays(np.float32, (ROWS, BIAS_ENTRIES), elements=bias_entry_values))
    bias_values[used:] = 0.0

    token_ids = draw(hnp.arrays(np.int32, (ROWS, HISTORY), elements=st.integers(0, VOCAB - 1))) % token_range
    lengths = np.array(draw(st.lists(st.integers(0, HISTORY), min_size=ROWS, max_size=ROWS)))
    token_ids[np.arange(HISTORY)[None, :] >= lengths[:, None]] = -1
    num_prompt_tokens = np.array(draw(st.lists(st.integers(0, HISTORY), min_size=ROWS, max_size=ROWS)), np.int32)

    def per_row(values, off):
        column = np.array(draw(st.lists(values, min_size=ROWS, max_size=ROWS)), np.float32)
        column[used:] = off
        return column

    presence, frequency = per_row(penalty_values, 0.0), per_row(penalty_values, 0.0)
    penalties = PenaltyInputs(token_ids, num_prompt_tokens, presence, frequency, per_row(repetition_values, 1.0))
    return used, logits, allowed, bias_ids, bias_values, penalties


@settings(max_examples=30, deadline=None)
@given(batches())
def test_matches_vllm_reference(batch):
    used, logits, allowed, bias_ids, bias_values, penalties = batch
    p = penalties
    expected = reference(
        logits, allowed, bias_ids, bias_values, p.token_ids, p.num_prompt_tokens, p.presence, p.frequency, p.repetition
    )
    ours = np.asarray(apply_jit(logits, LogitsInputs(pack_bitmask(allowed), bias_ids, bias_values, penalties)))
    # Biases of a repeated id may be added in another order: rounding of sums up to ~200 is ~1e-5 absolute.
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=3e-5)
    assert same_bits(ours[used:], logits[used:])


def test_everything_off_is_unchanged_bit_for_bit():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((ROWS, VOCAB)) * 5).astype(np.float32)
    logits[:, :4] = [0.0, -0.0, -np.inf, 1e-30]
    token_ids = rng.integers(-1, VOCAB, (ROWS, HISTORY)).astype(np.int32)
    off = PenaltyInputs(
        token_ids,
        np.full(ROWS, 3, np.int32),
        np.zeros(ROWS, np.float32),
        np.zeros(ROWS, np.float32),
        np.ones(ROWS, np.float32),
    )
    bias_ids = rng.integers(0, VOCAB, (ROWS, BIAS_ENTRIES)).astype(np.int32)
    bias_values = np.zeros((ROWS, BIAS_ENTRIES), np.float32)
    for penalties in (off, None):
        ours = apply_jit(logits, LogitsInputs(all_allowed(ROWS, VOCAB), bias_ids, bias_values, penalties))
        assert same_bits(ours, logits)


def test_minus_inf_stays_minus_inf():
    logits = np.array([[1.0, -2.0, 0.0, 4.0]], np.float32)
    allowed = pack_bitmask(np.array([[True, False, False, True]]))
    bias_ids, bias_values = np.array([[1, 2]], np.int32), np.array([[100.0, 50.0]], np.float32)
    # Tokens 1 and 2 are in the output, with negative penalties that would raise them.
    penalties = PenaltyInputs(
        np.array([[1, 2, 1, 0]], np.int32),
        np.zeros(1, np.int32),
        np.array([-2.0], np.float32),
        np.array([-2.0], np.float32),
        np.array([0.5], np.float32),
    )
    ours = np.asarray(apply_jit(logits, LogitsInputs(allowed, bias_ids, bias_values, penalties)))
    assert np.isneginf(ours[0, 1:3]).all()
    assert np.isfinite(ours[0, [0, 3]]).all()


def test_bad_shapes_raise():
    logits = np.zeros((2, 40), np.float32)
    with pytest.raises(ValueError, match="allowed"):
        apply_logits_processors(logits, LogitsInputs(np.zeros((2, 1), np.int32), *no_bias(2), None))
    with pytest.raises(ValueError, match="bias_ids"):
        bias_ids, bias_values = np.zeros((2, 3), np.int32), np.zeros((2, 2), np.float32)
        apply_logits_processors(logits, LogitsInputs(all_allowed(2, 40), bias_ids, bias_values, None))
    with pytest.raises(ValueError, match="rows, vocab"):
        pack_bitmask(np.zeros(5, bool))
