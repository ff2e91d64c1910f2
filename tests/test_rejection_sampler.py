"""Verification of speculative drafts: greedy rows give exactly the target's greedy tokens, and sampled rows keep
the target's distribution (a chi-square test over many seeded rows that a biased verifier fails)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxpage.sample.rejection_sampler import target_probs, verify_drafts
from jaxpage.sample.sampler import SamplingMetadata

VOCAB = 5
K = 3  # draft tokens per step


def metadata(num_rows, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, steps=None, seeds=None):
    full = np.full
    return SamplingMetadata(
        temperature=full(num_rows, temperature, np.float32),
        top_k=full(num_rows, top_k, np.int32),
        top_p=full(num_rows, top_p, np.float32),
        min_p=full(num_rows, min_p, np.float32),
        seeds=np.arange(num_rows, dtype=np.uint32) if seeds is None else seeds,
        steps=np.zeros(num_rows, np.int32) if steps is None else steps,
    )


def test_greedy_rows_keep_the_matching_prefix_and_add_the_targets_token():
    rng = np.random.default_rng(0)
    rows, vocab = 64, 11
    logits = rng.standard_normal((rows, K + 1, vocab)).astype(np.float32)
    greedy = logits.argmax(-1)
    # Drafts that follow the target for a random number of tokens, then differ.
    drafts = np.where(rng.random((rows, K)) < 0.7, greedy[:, :K], (greedy[:, :K] + 1) % vocab).astype(np.int32)
    num_drafts = rng.integers(0, K + 1, rows).astype(np.int32)
    out = verify_drafts(jnp.asarray(logits), metadata(rows), jnp.asarray(drafts), jnp.asarray(num_drafts))
    for r in range(rows):
        n = 0
        while n < num_drafts[r] and drafts[r, n] == greedy[r, n]:
            n += 1
        want = [*drafts[r, :n], greedy[r, n]] + [-1] * (K - n)
        assert int(out.num_accepted[r]) == n
        assert np.asarray(out.token_ids[r]).tolist() == want


# A toy target: the next token's logits depend on the previous token only (a bigram table), so that the logits at
# each verified position are what the target would compute after that draft token.
TARGET = np.random.default_rng(1).standard_normal((VOCAB, VOCAB)).astype(np.float32) * 1.5
DRAFT = TARGET + np.random.default_rng(2).standard_normal((VOCAB, VOCAB)).astype(np.float32)  # close, not equal
FIRST_CONTEXT = 3  # the prompt's last token


def generate_two(settings: dict, method: str, num_rows: int, verified_as=None) -> np.ndarray:
    """The first two generated tokens of num_rows seeded rows, generated speculatively. `verified_as`: the draft
    distribution the verifier is told (default: the true one), to build a biased verifier."""
    rng = np.random.default_rng(3)
    draft_table = np.asarray(target_probs(jnp.asarray(DRAFT), metadata(VOCAB, **settings)))
    outputs = [[] for _ in range(num_rows)]
    while any(len(o) < 2 for o in outputs):
        contexts = np.array([o[-1] if o else FIRST_CONTEXT for o in outputs])
        if method == "ngram":  # a deterministic guess: a point mass
            drafts = np.stack([(contexts + 1 + j) % VOCAB for j in range(K)], axis=1)
            draft_probs = None
        else:  # sampled from the draft model, one token after another
            drafts, draft_probs, previous = [], [], contexts
            for _ in range(K):
                q = draft_table[previous]
                token = (rng.random((num_rows, 1)) > np.cumsum(q, axis=1)).sum(axis=1).clip(0, VOCAB - 1)
                drafts.append(token)
                draft_probs.append(q if verified_as is None else verified_as[previous])
                previous = token
            drafts, draft_probs = np.stack(drafts, axis=1), jnp.asarray(np.stack(draft_probs, axis=1))
        # The target's logits after the context and after each draft token.
        logits = TARGET[np.concatenate([contexts[:, None], drafts], axis=1)]
        steps = np.array([len(o) for o in outputs], np.int32)
        out = verify_drafts(
            jnp.asarray(logits),
            metadata(num_rows, **settings, steps=steps),
            jnp.asarray(drafts, jnp.int32),
            jnp.full(num_rows, K, jnp.int32),
            draft_probs,
        )
        for r, tokens in enumerate(np.asarray(out.token_ids)):
            outputs[r] += [t for t in tokens.tolist() if t >= 0]
    return np.array([o[:2] for o in outputs])


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=3),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.15),
]


def chi_square_p_value(pairs: np.ndarray, settings: dict) -> float:
    """p-value of the observed (first, second) token pairs against plain sampling from the target."""
    p = np.asarray(target_probs(jnp.asarray(TARGET), metadata(VOCAB, **settings)), np.float64)
    expected = p[FIRST_CONTEXT][:, None] * p  # P(t1) P(t2 | t1)
    observed = np.zeros((VOCAB, VOCAB))
    np.add.at(observed, (pairs[:, 0], pairs[:, 1]), 1)
    assert observed[expected == 0].sum() == 0, "a token plain sampling never gives"
    cells = expected > 0
    expected = expected[cells] / expected[cells].sum() * len(pairs)
    return stats.chisquare(observed[cells], expected).pvalue


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_speculation_keeps_the_targets_distribution(method, settings):
    pairs = generate_two(settings, method, num_rows=20000)
    assert chi_square_p_value(pairs, settings) > 1e-3


def test_a_biased_verifier_fails_the_same_test():
    # Told that the draft came from the uniform distribution when it came from the draft model, the verifier
    # accepts the draft's likely tokens too often: the output leans towards the draft model.
    settings = SETTINGS[0]
    uniform = np.full((VOCAB, VOCAB), 1 / VOCAB, np.float32)
    pairs = generate_two(settings, "draft_model", num_rows=20000, verified_as=uniform)
    assert chi_square_p_value(pairs, settings) < 1e-6


def test_verification_is_jittable_and_seeded():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, K + 1, 7)), jnp.float32)
    args = (logits, metadata(4, temperature=1.0), jnp.zeros((4, K), jnp.int32), jnp.array([0, 1, 2, 3], jnp.int32))
    first = jax.jit(verify_drafts)(*args)
    again = verify_drafts(*args)
    assert (np.asarray(first.token_ids) == np.asarray(again.token_ids)).all()
    assert (np.asarray(first.num_accepted) <= np.array([0, 1, 2, 3])).all()
