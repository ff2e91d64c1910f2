"""Sampler: greedy is argmax, seeded rows ignore their batch, frequencies match the filtered distribution."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxpage.sample import sampler
from jaxpage.sample.sampler import SamplingMetadata, sample, sampling_metadata_from_params
from jaxpage.sampling_params import SamplingParams

sample_jit = jax.jit(sample, static_argnames="num_logprobs")


def metadata(rows: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=0, steps=0) -> SamplingMetadata:
    """Per-row arrays; each setting is a scalar for every row or a sequence of `rows` values."""

    def full(value, dtype):
        return np.broadcast_to(np.asarray(value, dtype), (rows,)).copy()

    return SamplingMetadata(
        temperature=full(temperature, np.float32),
        top_k=full(top_k, np.int32),
        top_p=full(top_p, np.float32),
        min_p=full(min_p, np.float32),
        seeds=full(seeds, np.uint32),
        steps=full(steps, np.int32),
    )


def tokens(logits, md: SamplingMetadata) -> np.ndarray:
    return np.asarray(sample_jit(np.asarray(logits, np.float32), md).token_ids)


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


# --- greedy -----------------------------------------------------------------------------------------------------


def test_greedy_is_argmax_with_ties_on_lowest_index():
    logits = random_logits(8, 1000)
    logits[1, [3, 500, 999]] = 50.0  # a three-way tie for the maximum
    logits[2, :] = -1.0  # everything tied
    logits[3, [998, 999]] = 50.0
    # Greedy rows ignore their own filter settings.
    md = metadata(8, temperature=0.0, top_k=[0, 1, 5, 100, 0, 0, 3, 0], top_p=0.5, min_p=[0.0, 0.9] * 4)
    got = tokens(logits, md)
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    assert list(got[1:4]) == [3, 0, 998]


def test_greedy_rows_unaffected_by_other_rows():
    logits = random_logits(8, 1000, seed=1)
    greedy = [0, 2, 5]
    temperature = np.array([0.0, 1.0, 0.0, 0.7, 2.0, 0.0, 1.0, 0.5], np.float32)
    mixed = metadata(8, temperature=temperature, top_k=[0, 100, 0, 5, 0, 0, 0, 0], top_p=[1, 1, 1, 0.9, 0.5, 1, 1, 1])
    got = tokens(logits, mixed)
    np.testing.assert_array_equal(got[greedy], np.argmax(logits[greedy], axis=-1))
    np.testing.assert_array_equal(got, tokens(logits, mixed))  # deterministic


# --- seeds ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [dict(), dict(top_p=0.9), dict(top_k=200, min_p=0.01)])
def test_seeded_row_ignores_its_batch_and_position(settings):
    vocab = 1000
    row = random_logits(1, vocab, seed=2, scale=1.0)
    others = random_logits(8, vocab, seed=3)
    for seed, step in [(1234, 0), (1234, 7), (2**32 - 1, 3), (5, 1000)]:
        alone = tokens(row, metadata(1, temperature=0.9, seeds=seed, steps=step, **settings))[0]
        for position in (0, 3, 7):
            logits = others.copy()
            logits[position] = row[0]
            md = metadata(8, temperature=[0.0, 1.0, 0.5, 1.3] * 2, top_k=[0, 100, 0, 3] * 2, seeds=range(8), steps=9)
            for name, value in {"temperature": 0.9, "seeds": seed, "steps": step, "top_k": 0, **settings}.items():
                getattr(md, name)[position] = value
            assert tokens(logits, md)[position] == alone, (seed, step, position)


# --- distributions (vocab 8, 4000 seeds) ------------------------------------------------------------------------

N = 4000
PROBS = np.array([0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0], np.float64)


def frequencies(logits_row, **settings) -> np.ndarray:
    logits = np.broadcast_to(np.asarray(logits_row, np.float32), (N, len(logits_row)))
    drawn = tokens(logits, metadata(N, seeds=np.arange(N), steps=11, **settings))
    return np.bincount(drawn, minlength=len(logits_row)) / N


def assert_matches(freq: np.ndarray, probs: np.ndarray):
    """Each token's frequency within 5 standard errors of its probability; tokens of probability 0 never drawn."""
    probs = probs / probs.sum()
    stderr = np.sqrt(probs * (1 - probs) / N)
    assert np.all(np.abs(freq - probs) <= 5 * stderr + 1e-12), (freq.round(4), probs.round(4))


def probs_logits() -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(np.where(PROBS > 0, PROBS, 1e-30)).astype(np.float32)  # tokens 4..7: probability ~1e-30


def test_steps_and_seeds_change_the_key():
    logits = np.zeros((N, 8), np.float32)  # uniform over 8 tokens
    over_steps = tokens(logits, metadata(N, seeds=7, steps=np.arange(N)))
    over_seeds = tokens(logits, metadata(N, seeds=np.arange(N), steps=3))
    for drawn in (over_steps, over_seeds):
        assert_matches(np.bincount(drawn, minlength=8) / N, np.ones(8))
    assert not np.array_equal(over_steps, over_seeds)


def test_temperature_matches_softmax():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5], np.float32)
    for temperature in (1.0, 0.6, 2.5):
        scaled = np.exp(logits / temperature)
        assert_matches(frequencies(logits, temperature=temperature), scaled / scaled.sum())


def test_top_k_keeps_the_k_largest_renormalized():
    logits = np.array([0.1, 2.0, -1.0, 1.5, 0.0, 1.0, -3.0, 0.5], np.float32)
    freq = frequencies(logits, top_k=2)
    keep = np.isin(np.arange(8), [1, 3])
    assert_matches(freq, np.where(keep, np.exp(logits), 0))
    freq = frequencies(logits, top_k=3, temperature=2.0)
    keep = np.isin(np.arange(8), [1, 3, 5])
    assert_matches(freq, np.where(keep, np.exp(logits / 2), 0))


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.79, [0, 1]), (0.81, [0, 1, 2]), (0.96, [0, 1, 2, 3]), (0.4, [0]), (0.01, [0])],
)
def test_top_p_keeps_exactly_the_nucleus(top_p, kept):
    # probabilities 0.5, 0.3, 0.15, 0.05: the nucleus of 0.79 is {0, 1} (0.8), of 0.81 is {0, 1, 2} (0.95).
    freq = frequencies(probs_logits(), top_p=top_p)
    assert_matches(freq, np.where(np.isin(np.arange(8), kept), PROBS, 0))


def test_top_p_applies_to_what_top_k_kept():
    # After top-k 3 the probabilities are 0.5, 0.3, 0.15 over 0.95: {0, 1} already holds 0.84 >= 0.83.
    # Without top-k {0, 1} holds 0.8 < 0.83, so token 2 stays.
    assert_matches(frequencies(probs_logits(), top_k=3, top_p=0.83), np.where(np.arange(8) < 2, PROBS, 0))
    assert_matches(frequencies(probs_logits(), top_p=0.83), np.where(np.arange(8) < 3, PROBS, 0))


@pytest.mark.parametrize("min_p, kept", [(0.25, 3), (0.09, 4), (0.7, 1), (1.0, 1)])
def test_min_p_drops_tokens_below_min_p_times_the_top(min_p, kept):
    # 0.25 * 0.5 = 0.125: 0.15 stays, 0.05 goes; 0.09 * 0.5 = 0.045: 0.05 stays; 0.7 and 1.0 keep the top token.
    assert_matches(frequencies(probs_logits(), min_p=min_p), np.where(np.arange(8) < kept, PROBS, 0))


# --- filters on a large vocabulary (the bisection fallback beyond the 64 candidates) -----------------------------


def reference_kept(logits_row, temperature, top_k, top_p, min_p) -> np.ndarray:
    """The kept token set by sorting, in float64: temperature, top-k, top-p on the renormalized rest, min-p."""
    probs = np.exp((logits_row - logits_row.max()) / temperature)
    order = np.argsort(-probs, kind="stable")
    keep = np.ones(len(probs), bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1:
        sorted_probs = np.where(keep[order], probs[order], 0)
        cumulative = np.cumsum(sorted_probs) / sorted_probs.sum()
        keep[order[np.searchsorted(cumulative, top_p) + 1 :]] = False
    return keep & (probs >= min_p * probs.max())


@pytest.mark.parametrize(
    "top_k, top_p, min_p",
    [(5, 1.0, 0.0), (64, 1.0, 0.0), (65, 1.0, 0.0), (700, 1.0, 0.0), (0, 0.9, 0.0), (0, 0.3, 0.0), (0, 0.999, 0.0),
     (300, 0.95, 0.0), (40, 0.9, 0.0), (0, 1.0, 0.05), (500, 0.7, 0.02)],
)  # fmt: skip
def test_filters_keep_the_reference_set(top_k, top_p, min_p):
    vocab, rows = 2000, 6
    logits = random_logits(rows, vocab, seed=4, scale=1.0)
    logits[1] *= 4  # a peaked row: its nucleus fits in the candidates
    logits[2] = np.round(logits[2])  # many ties
    temperature = np.array([1.0, 1.0, 1.0, 0.5, 2.0, 1.0], np.float32)
    scaled = (logits - logits.max(-1, keepdims=True)) / temperature[:, None]
    weights = jax.numpy.exp(scaled)
    md = metadata(rows, top_k=top_k, top_p=top_p, min_p=min_p)
    got = np.asarray(jax.jit(sampler._apply_filters)(weights, md.top_k, md.top_p, md.min_p)) > 0
    for row in range(rows):
        want = reference_kept(logits[row].astype(np.float64), temperature[row], top_k, top_p, min_p)
        if row == 2:  # ties at the threshold are all kept: compare the smallest kept probability instead
            assert scaled[2][got[2]].min() == scaled[2][want].min()
        else:
            np.testing.assert_array_equal(got[row], want, err_msg=f"row {row}")


def test_large_top_k_never_samples_outside_it():
    vocab, rows, top_k = 1000, 8, 100
    logits = np.broadcast_to(random_logits(1, vocab, seed=5, scale=0.5), (rows, vocab))
    drawn = np.concatenate([tokens(logits, metadata(rows, top_k=top_k, seeds=range(rows), steps=i)) for i in range(60)])
    assert np.isin(drawn, np.argsort(-logits[0])[:top_k]).all()
    assert len(set(drawn.tolist())) > 50


# --- logprobs ---------------------------------------------------------------------------------------------------


def test_logprobs_are_the_raw_distribution():
    logits = random_logits(6, 300, seed=6)
    md = metadata(6, temperature=[0.0, 1.0, 0.5, 2.0, 1.0, 0.0], top_k=[0, 10, 0, 0, 3, 0], seeds=range(6))
    out = sample_jit(logits, md, num_logprobs=5)
    log_softmax = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    token_ids = np.asarray(out.token_ids)
    np.testing.assert_array_equal(token_ids, tokens(logits, md))  # asking for logprobs changes no token
    np.testing.assert_allclose(out.logprobs, log_softmax[np.arange(6), token_ids], rtol=1e-6)
    top5 = np.argsort(-log_softmax, axis=-1, kind="stable")[:, :5]
    np.testing.assert_array_equal(out.top_logprob_ids, top5)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(log_softmax, top5, axis=-1), rtol=1e-6)
    assert out.top_logprob_ids.dtype == np.int32 and out.top_logprobs.dtype == np.float32

    only_sampled = sample_jit(logits, md, num_logprobs=0)
    np.testing.assert_array_equal(only_sampled.logprobs, out.logprobs)
    assert only_sampled.top_logprob_ids.shape == only_sampled.top_logprobs.shape == (6, 0)

    none = sample_jit(logits, md)
    assert none.logprobs is None and none.top_logprob_ids is None and none.top_logprobs is None


# --- host side --------------------------------------------------------------------------------------------------


def test_sampling_metadata_from_params_maps_fields_and_pads_greedy():
    params = [
        SamplingParams(temperature=0.7, top_k=-1, top_p=0.9, min_p=0.1, seed=3),
        None,
        SamplingParams(temperature=0.0, top_k=20),
        SamplingParams(),
    ]
    md = sampling_metadata_from_params(params, steps=[0, 5, 2, 9], seeds=[3, 0, -1, 2**40 + 7], num_rows=6)
    np.testing.assert_allclose(md.temperature, [0.7, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(md.top_k, [0, 0, 20, 0, 0, 0])
    np.testing.assert_allclose(md.top_p, [0.9, 1, 1, 1, 1, 1])
    np.testing.assert_allclose(md.min_p, [0.1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(md.seeds, [3, 0, 2**32 - 1, 7, 0, 0])
    np.testing.assert_array_equal(md.steps, [0, 5, 2, 9, 0, 0])
    dtypes = [md.temperature.dtype, md.top_k.dtype, md.top_p.dtype, md.min_p.dtype, md.seeds.dtype, md.steps.dtype]
    assert dtypes == [np.float32, np.int32, np.float32, np.float32, np.uint32, np.int32]

    logits = random_logits(6, 300, seed=7)
    got = tokens(logits, md)
    np.testing.assert_array_equal(got[[1, 2, 4, 5]], np.argmax(logits[[1, 2, 4, 5]], axis=-1))


def test_sampling_metadata_from_params_rejects_bad_lengths():
    with pytest.raises(ValueError, match="differ in length"):
        sampling_metadata_from_params([SamplingParams()], steps=[0, 1], seeds=[0], num_rows=4)
    with pytest.raises(ValueError, match="num_rows=1"):
        sampling_metadata_from_params([None, None], steps=[0, 0], seeds=[0, 0], num_rows=1)


def test_one_compiled_function_serves_every_mix():
    logits = random_logits(8, 1000, seed=8)
    traces = []

    @jax.jit
    def step(logits, md):
        traces.append(1)
        return sample(logits, md)

    for md in [
        metadata(8, temperature=0.0),
        metadata(8, temperature=0.8),
        metadata(8, top_p=0.5),
        metadata(8, top_k=[0, 80, 0, 0] * 2),
        metadata(8, min_p=0.2),
    ]:
        step(logits, md).token_ids.block_until_ready()
    assert len(traces) == 1


def test_row_uniforms_are_uniform_and_independent_across_seeds_steps_and_counters():
    """The hash behind every draw: a million uniforms of 1000 seeds x 1000 consecutive steps fill 100 bins evenly
    (chi-square per degree of freedom near 1), in [0, 1), uncorrelated between counters and between steps."""
    from jaxpage.sample.sampler import row_uniforms

    seeds = np.repeat(np.arange(1000, dtype=np.uint32), 1000)
    steps = np.tile(np.arange(1000, dtype=np.int32), 1000)
    u = np.asarray(row_uniforms(seeds, steps))
    assert u.shape == (10**6, 2) and u.min() >= 0 and u.max() < 1
    for column in u.T:
        counts = np.histogram(column, bins=100, range=(0, 1))[0]
        assert ((counts - 10**4) ** 2 / 10**4).sum() / 99 < 1.5
    assert abs(np.corrcoef(u[:, 0], u[:, 1])[0, 1]) < 0.01 and abs(np.corrcoef(u[:-1, 0], u[1:, 0])[0, 1]) < 0.01
