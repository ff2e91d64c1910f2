"""On-device sampling from per-row parameter arrays, inside the engine's jitted step.

One row per sequence in the batch (rows may be padding). Each row has its own temperature, top-k, top-p,
min-p, seed and step; only the sampled token ids (and, when asked, logprobs) leave the device.

How a row is sampled:
- temperature < 1e-5 (vLLM's epsilon; padding rows use 0): greedy, exactly `jnp.argmax` (ties: lowest index).
  A batch whose rows are all greedy runs only that argmax (under `lax.cond`).
- otherwise, in vLLM v0's order: scale the logits by 1 / temperature, then keep the top-k tokens, then the top-p
  nucleus of what is left (renormalized), then drop tokens whose probability is below min_p times the top
  token's, and draw one token from the renormalized rest.

No sort. Each filter is a per-row probability threshold (a token is kept iff its probability is >= it). The
top-k and top-p thresholds are read off the row's 64 largest probabilities (`lax.top_k`) when those hold them:
always for top_k <= 64, and for top-p when they reach the nucleus mass. Otherwise they are found exactly by
bisection on the float32 bit pattern, 30 passes over the rows: about ten times cheaper than sorting [rows, vocab]
on CPU. Which method serves a row depends on that row alone. Ties at a threshold are all kept (for top-k as vLLM
does; for top-p vLLM's sort keeps an arbitrary subset of them). Filters run under `lax.cond` on whether any row
uses them, so a batch without filters pays nothing for them, and one compiled function serves every mix.

The draw is an inverse-CDF lookup in two levels (pick a block of the vocabulary by its mass with one uniform,
then a token inside it with a second), so a row needs two random numbers, not one per vocabulary entry as
Gumbel-max does. The uniforms are a hash of (seed, step) (`row_uniforms`): a seeded request's tokens depend only on
its own logits, seed and step, never on the other rows or its row position. Greedy rows take the same lookup with
uniforms of 0 over the indicator of their maximum, which lands on its lowest index.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpage.sampling_params import GREEDY_SETTINGS, SamplingParams, sampler_settings

GREEDY_TEMPERATURE = 1e-5  # below this a row is greedy (vLLM's _SAMPLING_EPS)

_ONE_BITS = 0x3F800000  # float32 1.0 as int32; probabilities relative to the top token lie in [0, 1]
_BISECT_STEPS = 30  # ceil(log2(_ONE_BITS + 1)): enough to pin any float32 in [0, 1] exactly
_CANDIDATES = 64  # top-k / top-p thresholds come from each row's 64 largest weights when those hold them


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling settings for one step. The host fills these with numpy arrays of the same dtypes."""

    temperature: jax.Array  # [S] float32; < 1e-5 (0 for padding) means greedy
    top_k: jax.Array  # [S] int32; 0, -1 or >= vocab means off
    top_p: jax.Array  # [S] float32; 1.0 means off
    min_p: jax.Array  # [S] float32; 0.0 means off
    seeds: jax.Array  # [S] uint32: the request's seed (mod 2**32)
    steps: jax.Array  # [S] int32: tokens the request has generated so far (index of the token being sampled)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """What goes back to the host. Logprobs are of the raw model distribution: log_softmax of the logits,
    before temperature and filters (vLLM's default "raw_logprobs")."""

    token_ids: jax.Array  # [S] int32
    logprobs: jax.Array | None  # [S] float32: log-prob of the sampled token; None unless asked
    top_logprob_ids: jax.Array | None  # [S, num_logprobs] int32: most likely tokens, most likely first
    top_logprobs: jax.Array | None  # [S, num_logprobs] float32


def sample(logits: jax.Array, metadata: SamplingMetadata, num_logprobs: int | None = None) -> SamplerOutput:
    """Sample one token per row (greedy where temperature < GREEDY_TEMPERATURE); see the module docstring.

    logits:        [S, vocab] float (computed in float32).
    metadata:      per-row settings, each field [S].
    num_logprobs:  static. None: no logprobs (those leaves are None). n >= 0: the sampled token's logprob and
                   the n most likely tokens with theirs (n = 0 gives [S, 0] arrays).
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {logits.shape}")
    if num_logprobs is not None and not 0 <= num_logprobs <= logits.shape[1]:
        raise ValueError(f"num_logprobs must be None or in [0, vocab={logits.shape[1]}], got {num_logprobs}")
    logits = logits.astype(jnp.float32)
    greedy = metadata.temperature.astype(jnp.float32) < GREEDY_TEMPERATURE
    # A batch of greedy rows only (the common case, padding rows included) is one argmax: about 7x cheaper than
    # the sampling path, which gives the same tokens.
    token_ids = lax.cond(
        jnp.all(greedy), lambda *_: jnp.argmax(logits, axis=-1).astype(jnp.int32), _sample, logits, metadata
    )

    if num_logprobs is None:
        return SamplerOutput(token_ids, None, None, None)
    return SamplerOutput(token_ids, *sampled_logprobs(logits, token_ids, num_logprobs))


def sampled_logprobs(
    logits: jax.Array,  # [S, vocab] float32
    token_ids: jax.Array,  # [S] int32
    num: int,  # static, 0 <= num <= vocab
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log-prob of each row's token [S], the `num` most likely tokens [S, num] int32 most likely first, their
    log-probs [S, num]), of the raw distribution log_softmax(logits)."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    sampled = jnp.take_along_axis(logprobs, token_ids[:, None], axis=1)[:, 0]
    if num == 0:
        return sampled, jnp.zeros((logits.shape[0], 0), jnp.int32), jnp.zeros((logits.shape[0], 0), jnp.float32)
    top_values, top_ids = lax.top_k(logprobs, num)
    return sampled, top_ids.astype(jnp.int32), top_values


def target_logprobs(
    logits: jax.Array,  # [P, V] float32
    targets: jax.Array,  # [P] int32
    num: int,  # static, 1 <= num <= V
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Of each row's distribution log_softmax(logits): (the target token's log-prob [P], its rank [P] (1: the most
    likely; ties share the better rank), the `num` most likely tokens [P, num] int32 and their log-probs [P, num]).
    Prompt log-probs: the target is the prompt's next token."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    target = jnp.take_along_axis(logprobs, targets[:, None], axis=1)[:, 0]
    rank = jnp.sum(logprobs > target[:, None], axis=-1, dtype=jnp.int32) + 1
    top_values, top_ids = lax.top_k(logprobs, num)
    return target, rank, top_ids.astype(jnp.int32), top_values


def _sample(logits: jax.Array, metadata: SamplingMetadata) -> jax.Array:
    """[S] int32 token ids of float32 logits [S, vocab]: the general path, for any mix of rows."""
    return draw(filtered_weights(logits, metadata), metadata)


def draw(weights: jax.Array, metadata: SamplingMetadata) -> jax.Array:
    """[S] int32: a token of each row of `weights` [S, V] (a row's distribution, up to scale), drawn with the
    row's uniforms of (seed, step); greedy rows take their first token of positive weight."""
    greedy = metadata.temperature.astype(jnp.float32) < GREEDY_TEMPERATURE
    uniforms = jnp.where(greedy[:, None], 0.0, row_uniforms(metadata.seeds, metadata.steps))
    return inverse_cdf(weights, uniforms)


def filtered_weights(logits: jax.Array, metadata: SamplingMetadata) -> jax.Array:
    """[S, V] float32: each row's distribution after temperature, top-k, top-p and min-p, unnormalized (its top
    token weighs 1, dropped tokens 0). Greedy rows: the indicator of their maximum."""
    vocab = logits.shape[1]
    temperature = metadata.temperature.astype(jnp.float32)
    greedy = temperature < GREEDY_TEMPERATURE

    weights = _relative_probs(logits, temperature, greedy)
    top_k = jnp.where(greedy | (metadata.top_k >= vocab), 0, metadata.top_k).astype(jnp.int32)
    top_p = jnp.where(greedy, 1.0, metadata.top_p).astype(jnp.float32)
    min_p = jnp.where(greedy, 0.0, metadata.min_p).astype(jnp.float32)
    return lax.cond(
        jnp.any((top_k > 0) | (top_p < 1) | (min_p > 0)),
        _apply_filters,
        lambda w, *_: w,
        weights,
        top_k,
        top_p,
        min_p,
    )


def sampling_metadata_from_params(
    params: list[SamplingParams | None], steps: list[int], seeds: list[int], num_rows: int
) -> SamplingMetadata:
    """Host side (numpy): one row per entry, padded to num_rows with greedy rows.

    params: each row's settings; None makes a greedy (padding) row.
    steps:  tokens each row's request has generated so far.
    seeds:  each row's seed (the engine picks one for requests without `seed`); reduced mod 2**32.
    """
    if not len(params) == len(steps) == len(seeds):
        raise ValueError(f"params, steps and seeds differ in length: {len(params)}, {len(steps)}, {len(seeds)}")
    settings = [sampler_settings(p) for p in params]
    return sampling_metadata_from_settings(settings, steps, [seed % 2**32 for seed in seeds], num_rows)


def sampling_metadata_from_settings(
    settings: list[tuple], steps: list[int], seeds: list[int], num_rows: int
) -> SamplingMetadata:
    """sampling_metadata_from_params of each row's sampler_settings and seed in [0, 2**32)."""
    count = len(settings)
    if count > num_rows:
        raise ValueError(f"{count} rows do not fit in num_rows={num_rows}")
    table = np.array([(*GREEDY_SETTINGS, 0)] * num_rows, np.float64)
    if count:
        table[:count, :4], table[:count, 4] = settings, seeds
    row_steps = np.zeros(num_rows, np.int32)
    row_steps[:count] = steps
    return sampling_metadata_from_table(table, row_steps)


def sampling_metadata_from_table(table: np.ndarray, steps: np.ndarray) -> SamplingMetadata:
    """SamplingMetadata of [rows, 5] float64 rows (temperature, top_k, top_p, min_p, seed in [0, 2**32)) and each
    row's steps ([rows] int32)."""
    temperature, top_p, min_p = (table[:, column].astype(np.float32) for column in (0, 2, 3))
    top_k, seeds = table[:, 1].astype(np.int32), table[:, 4].astype(np.uint32)
    return SamplingMetadata(temperature, top_k, top_p, min_p, seeds, steps)


def _relative_probs(
    logits: jax.Array,  # [S, V] float32
    temperature: jax.Array,  # [S] float32
    greedy: jax.Array,  # [S] bool
) -> jax.Array:  # [S, V] float32
    """Each row's probabilities divided by its top token's (so the top token weighs exactly 1).

    Greedy rows get the indicator of their maximum instead."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    scale = (1.0 / jnp.where(greedy, 1.0, temperature))[:, None]
    return jnp.where(greedy[:, None], (logits == top).astype(jnp.float32), jnp.exp((logits - top) * scale))


def _apply_filters(
    weights: jax.Array,  # [S, V] float32, top token 1
    top_k: jax.Array,  # [S] int32, 0 off
    top_p: jax.Array,  # [S] float32, 1 off
    min_p: jax.Array,  # [S] float32, 0 off
) -> jax.Array:  # [S, V] float32, dropped tokens 0
    """top-k, then top-p on what top-k kept, then min-p; each keeps tokens at or above a per-row threshold."""
    zeros = jnp.zeros(weights.shape[:1], jnp.float32)
    k_threshold, p_threshold = lax.cond(
        jnp.any((top_k > 0) | (top_p < 1)), _top_k_top_p_thresholds, lambda *_: (zeros, zeros), weights, top_k, top_p
    )
    # The top token survives top-k and top-p and weighs 1, so min_p times its probability is just min_p.
    threshold = jnp.maximum(jnp.maximum(k_threshold, p_threshold), min_p)
    return jnp.where(weights >= threshold[:, None], weights, 0.0)


def _top_k_top_p_thresholds(
    weights: jax.Array,  # [S, V] float32, top token 1
    top_k: jax.Array,  # [S] int32, 0 off, < V
    top_p: jax.Array,  # [S] float32, 1 off
) -> tuple[jax.Array, jax.Array]:  # [S] float32 each, 0 where off
    """The k-th largest weight, and the weight of the least likely token of the top-p nucleus of what top-k kept.

    The nucleus is the smallest set of most likely tokens whose mass reaches top_p of the (top-k kept) row mass,
    so its threshold is the largest t for which the tokens weighing >= t carry that much. Both thresholds come
    from the row's _CANDIDATES largest weights (lax.top_k) when they hold them: always for top_k <= _CANDIDATES,
    and for top-p when the candidates alone reach the target mass. Otherwise they fall back to bisection."""
    num_candidates = min(_CANDIDATES, weights.shape[1])
    candidates = lax.top_k(weights, num_candidates)[0]  # [S, C] descending

    k_index = jnp.clip(top_k - 1, 0, num_candidates - 1)[:, None]
    k_threshold = jnp.where(top_k > 0, jnp.take_along_axis(candidates, k_index, axis=1)[:, 0], 0.0)
    beyond = top_k > num_candidates
    k_threshold = lax.cond(
        jnp.any(beyond), lambda: jnp.where(beyond, _bisect_top_k(weights, top_k), k_threshold), lambda: k_threshold
    )

    kept = jnp.where(weights >= k_threshold[:, None], weights, 0.0)
    target = top_p * jnp.sum(kept, axis=-1)
    cumulative = lax.cumsum(jnp.where(candidates >= k_threshold[:, None], candidates, 0.0), axis=1)
    p_index = jnp.minimum(jnp.sum(cumulative < target[:, None], axis=-1), num_candidates - 1)[:, None]
    p_threshold = jnp.take_along_axis(candidates, p_index, axis=1)[:, 0]
    found = (top_p >= 1) | (cumulative[:, -1] >= target)
    p_threshold = lax.cond(
        jnp.all(found), lambda: p_threshold, lambda: jnp.where(found, p_threshold, _bisect_top_p(kept, target))
    )
    return k_threshold, jnp.where(top_p < 1, p_threshold, 0.0)


def _bisect_top_k(weights: jax.Array, top_k: jax.Array) -> jax.Array:
    """[S] the k-th largest weight of each row: the largest t with at least k weights >= t."""

    # Counting in float32 is exact below 2**24 and a little faster than in int32 on CPU.
    def enough(t):
        return jnp.sum(jnp.where(weights >= t[:, None], 1.0, 0.0), axis=-1) >= top_k

    return _largest_passing(enough, weights.shape[0])


def _bisect_top_p(weights: jax.Array, target: jax.Array) -> jax.Array:
    """[S] the largest t for which the weights >= t add up to at least target."""

    def enough(t):
        return jnp.sum(jnp.where(weights >= t[:, None], weights, 0.0), axis=-1) >= target

    return _largest_passing(enough, weights.shape[0])


def _largest_passing(enough, num_rows: int) -> jax.Array:
    """[S] per row, the largest float32 t in [0, 1] with enough(t) true, for a test that is monotone (true
    below some t, false above); 0 when it fails everywhere.

    Non-negative float32 values order like their int32 bit patterns, so bisecting on the bits finds t exactly."""

    def step(_, bounds):
        lo, hi = bounds  # enough(lo) holds (or lo is 0); enough(hi) fails
        mid = lo + (hi - lo) // 2
        ok = enough(lax.bitcast_convert_type(mid, jnp.float32))
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo = jnp.zeros(num_rows, jnp.int32)
    hi = jnp.full(num_rows, _ONE_BITS + 1, jnp.int32)
    lo, _ = lax.fori_loop(0, _BISECT_STEPS, step, (lo, hi))
    return lax.bitcast_convert_type(lo, jnp.float32)


def row_uniforms(seeds: jax.Array, steps: jax.Array, count: int = 2) -> jax.Array:
    """[S, count] float32 in [0, 1) (24 random bits each): a counter-based hash of each row's (seed, step, i), so a
    function of its (seed, step) only. The hash is `_mix` (a bijection of uint32 with full avalanche) applied to the
    seed, then to it xor the step, then to that xor the counter: a few integer ops, which XLA compiles in
    milliseconds (jax.random's threefry took a quarter of a second per sampler program on CPU) and runs in less."""
    x = _mix(_mix(seeds.astype(jnp.uint32) ^ jnp.uint32(0x6A09E667)) ^ steps.astype(jnp.uint32))  # [S]
    counters = jnp.arange(count, dtype=jnp.uint32) * jnp.uint32(0x85EBCA6B) + jnp.uint32(0x632BE5AB)  # [count]
    bits = _mix(x[:, None] ^ counters[None, :])  # [S, count]
    return (bits >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def _mix(x: jax.Array) -> jax.Array:
    """uint32 -> uint32, a bijection in which every input bit flips each output bit with probability about 1/2
    (Wellons' "lowbias32" integer hash)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def inverse_cdf(
    weights: jax.Array,  # [S, V] float32 >= 0, each row with some positive weight
    uniforms: jax.Array,  # [S, 2] float32 in [0, 1)
) -> jax.Array:  # [S] int32
    """Draw token i with probability weights[i] / sum(weights) by a two-level inverse-CDF lookup.

    The first uniform picks a block of the vocabulary with probability proportional to its mass, the second a
    token inside it with probability proportional to its weight. A token of weight 0 is never picked. Uniforms
    of 0 pick the first positive weight."""
    num_rows, vocab = weights.shape
    block = 1 << math.ceil(math.log2(math.sqrt(vocab)))
    num_blocks = -(-vocab // block)
    blocks = jnp.pad(weights, ((0, 0), (0, num_blocks * block - vocab))).reshape(num_rows, num_blocks, block)

    block_id = _lookup(jnp.sum(blocks, axis=-1), uniforms[:, 0])
    chosen = jnp.take_along_axis(blocks, block_id[:, None, None], axis=1)[:, 0]  # [S, block]
    return block_id * block + _lookup(chosen, uniforms[:, 1])


def _lookup(
    mass: jax.Array,  # [S, N] float32 >= 0
    uniform: jax.Array,  # [S] float32 in [0, 1)
) -> jax.Array:  # [S] int32
    """The first index whose cumulative mass exceeds uniform * total mass (never one of mass 0)."""
    cumulative = lax.cumsum(mass, axis=1)
    index = jnp.sum(cumulative <= (uniform * cumulative[:, -1])[:, None], axis=-1, dtype=jnp.int32)
    # Rounding can put the target at the total; fall back to the last index with mass.
    positions = lax.broadcasted_iota(jnp.int32, mass.shape, 1)
    last = jnp.max(jnp.where(mass > 0, positions, 0), axis=-1)
    return jnp.minimum(index, last)
