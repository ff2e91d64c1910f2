"""Verification of speculative drafts: which draft tokens a sequence keeps, and the token that follows them.

A speculating sequence brings k draft tokens d_1..d_k; one step of the target model gives its logits at k + 1
positions (after the last accepted token, and after each draft token). Position j's distribution p_j is the
target's after the request's temperature, top-k, top-p and min-p (jaxpage.sample.sampler.filtered_weights), so that the
tokens that come out are distributed exactly as plain sampling from the target would give them (Leviathan et al.
2023, Chen et al. 2023):

- d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)), q_j being the draft's distribution there: the
  draft model's (after its own sampling settings), or for n-gram lookup a point mass on d_j (accepted with
  probability p_j(d_j));
- the first rejected position j emits one token drawn from max(p_j - q_j, 0), normalized; when every draft token
  is accepted, a bonus token is drawn from p_{k+1}.

Point-mass drafts (n-gram) are verified by a coupling of that rule: position j draws the token x_j that plain
sampling would draw there (the sampler's own function of the logits and the uniforms of (seed, step + j)), and
d_j is accepted iff x_j == d_j, which happens with probability p_j(d_j); on rejection, x_j is distributed as p_j
given x_j != d_j, which is max(p_j - point mass on d_j, 0) normalized. So the tokens are the ones decoding without
speculation gives, for sampled rows too: a seeded request's output does not depend on whether, or how much, it
speculated (up to float rounding between step shapes).

Greedy rows (temperature < 1e-5) have p_j = the one-hot of argmax (lowest index on ties, as `jnp.argmax`): a draft
token is accepted iff it is the target's greedy token, and the emitted token is the target's greedy token. Their
output is token for token what decoding without speculation gives.

Randomness: position j of a row draws the uniforms of (seed, step + j) (jaxpage.sample.sampler.row_uniforms): 2 for
point-mass drafts (the sampler's), 3 for draft distributions (two for the draw, one for acceptance): a seeded
request's tokens depend on its own logits, seed and position only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpage.sample.sampler import (
    GREEDY_TEMPERATURE,
    SamplingMetadata,
    filtered_weights,
    inverse_cdf,
    row_uniforms,
    sample,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifiedTokens:
    token_ids: jax.Array  # [S, k + 1] int32: the accepted draft tokens, then the emitted token; -1 after them
    num_accepted: jax.Array  # [S] int32: draft tokens accepted (the row emits num_accepted + 1 tokens)


def target_probs(logits: jax.Array, metadata: SamplingMetadata) -> jax.Array:
    """[N, V] float32: each row's sampling distribution, normalized; greedy rows the one-hot of their argmax."""
    weights = filtered_weights(logits, metadata)
    greedy = metadata.temperature.astype(jnp.float32) < GREEDY_TEMPERATURE
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy[:, None], one_hot, weights / jnp.sum(weights, axis=-1, keepdims=True))


def verify_drafts(
    logits: jax.Array,  # [S, k + 1, V] float: the target's logits at each row's k + 1 positions
    metadata: SamplingMetadata,  # [S] rows; steps = tokens generated before this step
    draft_tokens: jax.Array,  # [S, k] int32
    num_drafts: jax.Array,  # [S] int32 in [0, k]: the row's draft tokens (the rest of its k are padding)
    draft_probs: jax.Array | None = None,  # [S, k, V] float32 the draft model's distributions; None: point masses
) -> VerifiedTokens:
    num_rows, num_positions, vocab = logits.shape
    k = num_positions - 1
    positions = jnp.arange(num_positions)

    def per_position(x):  # a row's setting for each of its positions
        return jnp.repeat(x, num_positions)

    position_metadata = SamplingMetadata(
        temperature=per_position(metadata.temperature),
        top_k=per_position(metadata.top_k),
        top_p=per_position(metadata.top_p),
        min_p=per_position(metadata.min_p),
        seeds=per_position(metadata.seeds),
        steps=(metadata.steps[:, None] + positions[None, :]).reshape(-1),
    )
    if draft_probs is None:  # point masses: the coupling of the module docstring
        plain = sample(logits.reshape(-1, vocab), position_metadata).token_ids.reshape(num_rows, num_positions)
        accepted = (plain[:, :k] == draft_tokens) & (positions[None, :k] < num_drafts[:, None])
        num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1).astype(jnp.int32)
        token_ids = jnp.where(positions[None, :] <= num_accepted[:, None], plain, -1)
        return VerifiedTokens(token_ids.astype(jnp.int32), num_accepted)

    p = target_probs(logits.reshape(-1, vocab).astype(jnp.float32), position_metadata).reshape(logits.shape)
    # Position j of row s: 3 uniforms of (seed, step + j), as the sampler draws its 2.
    uniforms = row_uniforms(position_metadata.seeds, position_metadata.steps, 3).reshape(num_rows, num_positions, 3)

    # Acceptance of each draft token, then the accepted prefix.
    p_draft = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], axis=-1)[..., 0]  # [S, k]
    q_draft = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    accepted = (uniforms[:, :k, 2] * q_draft < p_draft) & (positions[None, :k] < num_drafts[:, None])
    num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1).astype(jnp.int32)  # [S]

    # The emitted token: from the residual at the first rejection, or the bonus after a fully accepted draft.
    rows = jnp.arange(num_rows)
    p_next = p[rows, num_accepted]  # [S, V]
    rejected = num_accepted < num_drafts
    if k == 0:
        distribution = p_next
    else:
        at = jnp.minimum(num_accepted, k - 1)
        q_next = draft_probs[rows, at].astype(jnp.float32)
        residual = jnp.maximum(p_next - q_next, 0.0)
        # A residual of no mass can only come from rounding (a rejection has probability 0 when p >= q): use p.
        usable = rejected & (jnp.sum(residual, axis=-1) > 0)
        distribution = jnp.where(usable[:, None], residual, p_next)
    greedy = metadata.temperature.astype(jnp.float32) < GREEDY_TEMPERATURE
    draw_uniforms = jnp.where(greedy[:, None], 0.0, uniforms[rows, num_accepted, :2])
    emitted = inverse_cdf(distribution, draw_uniforms)

    padded_drafts = jnp.pad(draft_tokens, ((0, 0), (0, 1)))
    token_ids = jnp.where(positions[None, :] < num_accepted[:, None], padded_drafts, -1)
    token_ids = jnp.where(positions[None, :] == num_accepted[:, None], emitted[:, None], token_ids)
    return VerifiedTokens(token_ids.astype(jnp.int32), num_accepted)
