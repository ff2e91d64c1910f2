"""One sequence's logits processors, host side (no jax): what its SamplingParams ask to change in its logits, in the
compact per-row form the jitted sampler takes (jaxpage.sample.logits_processors.LogitsInputs).

- a token bitmask (ceil(vocab / 32) int32 words, bit t % 32 of word t // 32 set iff token t may come next): the
  grammar's (an llguidance matcher, jaxpage.structured), AND allowed_token_ids, AND NOT bad words (the last token of a
  bad word whose other tokens end the output; one-token bad words always), AND NOT EOS and stop_token_ids while the
  output is shorter than min_tokens;
- logit_bias as (ids, values), at most SamplingParams.MAX_LOGIT_BIAS of them;
- presence, frequency and repetition penalties, which the sampler applies from the sequence's tokens.

Built once per sequence when its request is prepared (LLMEngine.prepare_request); the matcher is the sequence's own
and advances only where its tokens commit (Scheduler.update_from_output).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpage.sampling_params import SamplingParams

BITS_PER_WORD = 32  # tokens per int32 word of a token bitmask


def bitmask_words(vocab_size: int) -> int:
    """int32 words of a token bitmask over `vocab_size` tokens."""
    return -(-vocab_size // BITS_PER_WORD)


def pack_bitmask(allowed_bool: np.ndarray) -> np.ndarray:
    """[N, V] bool -> [N, ceil(V/32)] int32 bitmask in llguidance's layout (which
    jaxpage.sample.logits_processors.unpack_bitmask reads). Bits past V are left clear."""
    allowed_bool = np.asarray(allowed_bool, dtype=bool)
    if allowed_bool.ndim != 2:
        raise ValueError(f"allowed_bool must be [rows, vocab], got shape {allowed_bool.shape}")
    num_rows, vocab = allowed_bool.shape
    padded = np.zeros((num_rows, bitmask_words(vocab) * BITS_PER_WORD), dtype=bool)
    padded[:, :vocab] = allowed_bool
    # Little bit order puts token 8 k + j at bit j of byte k; read as little-endian int32, byte k of a word is its
    # bits 8 k .. 8 k + 7, so token 32 w + b lands at bit b of word w.
    packed = np.packbits(padded, axis=1, bitorder="little")  # [N, 4 W] uint8
    return packed.view("<i4").astype(np.int32)


def token_bitmask(token_ids, vocab_size: int) -> np.ndarray:
    """[ceil(vocab / 32)] int32 with the bits of `token_ids` set."""
    allowed = np.zeros((1, vocab_size), bool)
    allowed[0, np.asarray(list(token_ids), np.int64)] = True
    return pack_bitmask(allowed)[0]


def clear_bits(mask: np.ndarray, token_ids) -> None:
    """Clears the bits of `token_ids` in a bitmask row (in place)."""
    for t in token_ids:
        mask[t // 32] &= np.int32(~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF)


@dataclasses.dataclass(eq=False)
class LogitsControls:
    """What changes one sequence's logits (see the module docstring). `matcher` is the sequence's own."""

    vocab_size: int
    matcher: object | None = None  # llguidance.LLMatcher
    allowed: np.ndarray | None = None  # [words] int32: allowed_token_ids AND NOT one-token bad words; None: all
    bad_word_sequences: tuple[tuple[int, ...], ...] = ()  # bad words of several tokens
    min_tokens: int = 0
    min_tokens_stop_ids: tuple[int, ...] = ()  # masked until the output has min_tokens tokens
    eos_token_ids: tuple[int, ...] = ()  # what a row whose constraints contradict each other is left with
    bias_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    bias_values: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float32))
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def of(
        cls,
        params: SamplingParams,
        vocab_size: int,
        eos_token_ids,
        bad_word_token_ids: list[list[int]],
        matcher=None,
    ) -> LogitsControls | None:
        """The controls of a request's params (None when nothing changes its logits). bad_word_token_ids: each bad
        word's spellings as token ids (jaxpage.engine.input_processor tokenizes them); matcher: a fresh one for this
        sequence, for structured outputs."""
        if not params.uses_logits_processors:
            return None
        single = {w[0] for w in bad_word_token_ids if len(w) == 1}
        allowed = None
        if params.allowed_token_ids is not None or single:
            allowed = token_bitmask(params.allowed_token_ids or range(vocab_size), vocab_size)
            clear_bits(allowed, sorted(single))
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        bias = params.logit_bias or {}
        return cls(
            vocab_size,
            matcher,
            allowed,
            tuple(tuple(w) for w in bad_word_token_ids if len(w) > 1),
            params.min_tokens,
            tuple(sorted(stop_ids)),
            tuple(sorted(eos_token_ids)),
            np.fromiter(bias.keys(), np.int32, len(bias)),
            np.fromiter(bias.values(), np.float32, len(bias)),
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
        )

    def accept(self, token_id: int) -> None:
        """The sequence committed `token_id` (Sequence.append_token): the grammar's matcher advances. A token the
        grammar refuses (only sampling outside the mask could bring one) leaves the matcher in its error state,
        which `grammar_ended` reports."""
        if self.matcher is not None:
            self.matcher.consume_token(token_id)

    @property
    def grammar_ended(self) -> bool:
        """The grammar can take no more tokens: it is complete (or its matcher failed). The sequence ends."""
        return self.matcher is not None and (self.matcher.is_stopped() or self.matcher.is_error())

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def restrict(self, mask: np.ndarray, output_token_ids: list[int]) -> None:
        """Applies everything but the grammar to a bitmask row (in place; the grammar's mask, or all ones, is
        already there), for the token after `output_token_ids`. A row left with no token allows EOS alone (the
        constraints contradict each other, e.g. allowed_token_ids the grammar never accepts: the sequence ends)."""
        if self.allowed is not None:
            mask &= self.allowed
        banned = [w[-1] for w in self.bad_word_sequences if _ends_with(output_token_ids, w[:-1])]
        if len(output_token_ids) < self.min_tokens:
            banned += self.min_tokens_stop_ids
        clear_bits(mask, banned)
        if not mask.any() and self.eos_token_ids:
            mask[:] = token_bitmask(self.eos_token_ids, self.vocab_size)


def _ends_with(tokens: list[int], suffix: tuple[int, ...]) -> bool:
    return len(tokens) >= len(suffix) and tuple(tokens[len(tokens) - len(suffix) :]) == suffix
