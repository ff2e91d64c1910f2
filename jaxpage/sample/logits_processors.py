"""On-device logits processors: what happens to a batch's logits inside the jitted sampler before temperature,
top-k, top-p and min-p (jaxpage/sample/sampler.py).

One row per sequence, in vLLM's order (v1 sampler), with vLLM's formulas:
1. Allowed tokens: a token whose bit is clear in the row's bitmask gets -inf (structured output, allowed_token_ids).
2. logit_bias: each (token id, value) entry of the row is added to that token's logit; duplicate ids add up.
3. Penalties, exactly as vLLM's `apply_penalties`: a token seen in the prompt or the output has its logit divided by
   the repetition penalty when positive and multiplied by it otherwise (the CTRL paper's rule); then the frequency
   penalty times the token's count in the output and the presence penalty (once, if it occurs there) are subtracted
   (the OpenAI API's definition). Frequency and presence look at the output only.

Why a bitmask: a row's allowed set is 32 tokens per int32 word (V/32 words, about 5 KB for a 150k vocabulary,
instead of V bytes or V floats for a dense mask), and it is the layout llguidance fills
(`llguidance.numpy.fill_next_token_bitmask`): bit t % 32 of word t // 32, least significant bit first, so the host
hands the grammar engine's buffer over as is. -1 words allow everything.

The penalty step counts each row's tokens with a scatter over its history; it runs under `lax.cond` on whether any
row uses a penalty, so a batch without penalties pays nothing for it, and one compiled function serves every mix.
A batch where no request asks for penalties can also leave them out (`penalties=None`): the program then takes no
history at all.
Rows with everything off come out bit-for-bit unchanged; -inf stays -inf.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxpage.sample.logits_controls import BITS_PER_WORD, bitmask_words


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyInputs:
    """Per-row token histories and penalty settings for one step. The host fills these with numpy arrays."""

    token_ids: jax.Array  # [N, H] int32: each row's tokens so far, prompt then output; -1 past its end (padding)
    num_prompt_tokens: jax.Array  # [N] int32: the first num_prompt_tokens of a row's token_ids are its prompt
    presence: jax.Array  # [N] float32, 0 off
    frequency: jax.Array  # [N] float32, 0 off
    repetition: jax.Array  # [N] float32, 1 off


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogitsInputs:
    """Per-row inputs of `apply_logits_processors` for one step. The host fills these with numpy arrays."""

    # [N, ceil(V/32)] int32 bitmask: bit (t % 32) of word (t // 32) set iff token t may be sampled (llguidance's
    # layout; -1 words allow all). Bits past V are ignored.
    allowed: jax.Array
    bias_ids: jax.Array  # [N, B] int32 token ids in [0, V) of logit_bias entries (padding: any id with value 0)
    bias_values: jax.Array  # [N, B] float32 (already clipped to [-100, 100] by the host)
    penalties: PenaltyInputs | None  # None: no row uses penalties (the program then has no penalty arrays at all)


def apply_logits_processors(logits: jax.Array, inputs: LogitsInputs) -> jax.Array:
    """[N, V] float32 -> [N, V] float32: mask disallowed tokens, add logit_bias, apply penalties (module docstring).

    logits:  [N, V] float (computed in float32).
    inputs:  per-row arrays, each with N rows. Token ids (bias_ids, penalty histories) must lie in [0, V), except
             history padding (-1).
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {logits.shape}")
    num_rows, vocab = logits.shape
    num_words = bitmask_words(vocab)
    if inputs.allowed.shape != (num_rows, num_words):
        raise ValueError(f"allowed must be [{num_rows}, ceil({vocab}/32) = {num_words}], got {inputs.allowed.shape}")
    if inputs.bias_ids.shape != inputs.bias_values.shape or inputs.bias_ids.shape[:1] != (num_rows,):
        raise ValueError(
            f"bias_ids and bias_values must both be [{num_rows}, B], got {inputs.bias_ids.shape} and "
            f"{inputs.bias_values.shape}"
        )
    logits = logits.astype(jnp.float32)

    logits = jnp.where(unpack_bitmask(inputs.allowed, vocab), logits, -jnp.inf)

    # Padding entries add -0.0 rather than 0.0: x + -0.0 is x for every x, while -0.0 + 0.0 would be +0.0, and rows
    # without bias must come out bit-for-bit unchanged.
    bias_values = inputs.bias_values.astype(jnp.float32)
    bias_values = jnp.where(bias_values == 0, -0.0, bias_values)
    rows = jnp.arange(num_rows)[:, None]  # [N, 1]
    logits = logits.at[rows, inputs.bias_ids].add(bias_values)

    penalties = inputs.penalties
    if penalties is None:
        return logits
    if penalties.token_ids.ndim != 2 or penalties.token_ids.shape[0] != num_rows:
        raise ValueError(f"penalties.token_ids must be [{num_rows}, H], got {penalties.token_ids.shape}")
    for name in ("num_prompt_tokens", "presence", "frequency", "repetition"):
        if getattr(penalties, name).shape != (num_rows,):
            raise ValueError(f"penalties.{name} must be [{num_rows}], got {getattr(penalties, name).shape}")
    any_penalty = jnp.any((penalties.presence != 0) | (penalties.frequency != 0) | (penalties.repetition != 1))
    return lax.cond(any_penalty, _apply_penalties, lambda logits, _: logits, logits, penalties)


def unpack_bitmask(allowed: jax.Array, vocab: int) -> jax.Array:
    """[N, ceil(vocab/32)] int32 bitmask -> [N, vocab] bool: token t is allowed iff bit t % 32 of word t // 32 is set.

    vocab is static; bits past it are ignored."""
    num_rows, num_words = allowed.shape
    shifts = jnp.arange(BITS_PER_WORD, dtype=jnp.int32)  # [32]
    bits = (allowed.astype(jnp.int32)[:, :, None] >> shifts) & 1  # [N, W, 32]; word w, bit b is token 32 w + b
    return bits.reshape(num_rows, num_words * BITS_PER_WORD)[:, :vocab] != 0


def _apply_penalties(
    logits: jax.Array,  # [N, V] float32
    penalties: PenaltyInputs,
) -> jax.Array:  # [N, V] float32
    """vLLM's `apply_penalties`: repetition on tokens of the prompt or the output, then frequency and presence on
    tokens of the output."""
    num_rows, vocab = logits.shape
    token_ids = penalties.token_ids.astype(jnp.int32)  # [N, H]
    positions = jnp.arange(token_ids.shape[1], dtype=jnp.int32)[None, :]  # [1, H]
    in_output = positions >= penalties.num_prompt_tokens.astype(jnp.int32)[:, None]  # [N, H]
    # Padding (-1) and each part's tokens of the other part go to an extra column `vocab`, dropped after the scatter.
    padding = token_ids < 0
    output_ids = jnp.where(padding | ~in_output, vocab, token_ids)  # [N, H]
    prompt_ids = jnp.where(padding | in_output, vocab, token_ids)  # [N, H]
    rows = jnp.arange(num_rows)[:, None]  # [N, 1]
    output_counts = jnp.zeros((num_rows, vocab + 1), jnp.int32).at[rows, output_ids].add(1)[:, :vocab]  # [N, V]
    prompt_mask = jnp.zeros((num_rows, vocab + 1), bool).at[rows, prompt_ids].set(True)[:, :vocab]  # [N, V]
    output_mask = output_counts > 0  # [N, V]

    repetition = jnp.where(prompt_mask | output_mask, penalties.repetition.astype(jnp.float32)[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - penalties.frequency.astype(jnp.float32)[:, None] * output_counts.astype(jnp.float32)
    return logits - penalties.presence.astype(jnp.float32)[:, None] * output_mask.astype(jnp.float32)
