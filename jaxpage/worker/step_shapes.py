"""The static shapes a step is padded to (host side, no jax): each is compiled once, ahead of its first use.

Every step is padded to one of a few shapes:
  decode-only steps (every sequence has one new token): T tokens = S rows, 1, a power of two from 4, or 24 or 48,
      up to the most sequences a step can hold (min(max_num_seqs, max_num_batched_tokens), always the last);
  mixed steps (some sequence computes several tokens): T = 128, 512, 2048, ... up to max_num_batched_tokens (always
      the last), S = min(T, max_num_seqs); and small ones, T = 16 and 64 for S = 4 rows, for a short prompt with few
      sequences (a mixed step takes the smallest shape that holds both its tokens and its sequences);
  verify steps, with speculative decoding (k draft tokens at most per sequence, some sequence brings drafts, none
      has more than k + 1 new tokens): S = 1, 2, 4, ... up to max_verify_rows rows, T = S * (k + 1).
The sampler takes R >= S rows, R = 1, 8, 32, 128, ... up to the most sequences: it compiles once per R, shared by
decode and mixed steps. A verify step's sampler is the verification (jaxpage.sample.rejection_sampler): the LM head over
k + 1 positions of each of its S rows. Which kind a step is, is known here, on the host: a decode-only step compiles
only the decode attention, a verify step the ragged one told that no sequence has more than k + 1 query rows.
"""

from __future__ import annotations

import dataclasses

# Bucket sizes, by measurement (scripts/bench_throughput.py, SmolLM2 float32 on 2 cores). A decode step computes
# every row of its bucket, about 2 ms of model FLOPs per padding row here: decode buckets are powers of two from 4
# with 24 and 48 between (a step of 25-48 sequences took 420 ms padded to 32/64, 270-350 ms at 24/48). Mixed steps
# are mostly full prefill chunks: buckets 128, 512, 2048, ... and the token budget. The sampler's rows (its LM head
# reads every row) go by powers of 4 from 8: it compiles once per row count, shared by decode and mixed steps.
# One request alone has shapes of its own, a decode step of one row and a sampler of one row: with the default model
# (float32, batch 1, scripts/bench_latency.py) its decode step took 42.6 ms padded to 4 rows (LM head over 8) and
# 31.0 ms at one (the LM head of one row reads the embedding at 4.6 ms, of 8 rows at 10.2 ms).
MIN_DECODE_BUCKET = 4
DECODE_HALF_STEPS = (16, 32)  # decode buckets also at 1.5 x these: 24, 48
MIN_MIXED_BUCKET = 128
# A short prompt (a chat's turn) alone, or with a few decodes, prefills in a small mixed shape of its own, 16 or 64
# tokens for 4 sequences: a prefill step costs about its padded tokens' FLOPs here. With the default model (float32,
# scripts/bench_latency.py) a 16-token prompt's first token came after 243 ms padded to 128 tokens, 155 ms to 64,
# 67 ms to 16.
SMALL_MIXED_TOKENS, SMALL_MIXED_ROWS = (16, 64), 4
MIN_SAMPLE_ROWS = 8


def powers_of_two(lo: int, hi: int, factor: int = 2) -> list[int]:
    """lo, 2 lo, 4 lo, ... below hi, then hi itself (always the last; [hi] when hi <= lo). `factor` 4 gives lo,
    4 lo, 16 lo, ..."""
    buckets = []
    size = lo
    while size < hi:
        buckets.append(size)
        size *= factor
    return [*buckets, hi]


def bucket_for(n: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= n)


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    """The static shape of a step's forward pass."""

    num_tokens: int  # T
    num_rows: int  # S: sequence rows (block tables, kv lengths)
    sample_rows: int  # R >= S: rows of the sampler (its own, coarser buckets: it compiles once per R)
    max_q_len: int  # 1: decode-only; k + 1: verifies up to k draft tokens per row; 0: mixed (any q_len)

    @property
    def kind(self) -> str:
        return {0: "mixed", 1: "decode"}.get(self.max_q_len, "verify")

    @property
    def num_draft_positions(self) -> int:
        """k: draft tokens a row of this step's sampler can verify (0: it samples one token per row)."""
        return max(self.max_q_len - 1, 0)

    def __str__(self) -> str:
        k = f", k={self.num_draft_positions}" if self.num_draft_positions else ""
        return f"{self.kind}(T={self.num_tokens}, S={self.num_rows}, R={self.sample_rows}{k})"


def step_shapes(
    max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int = 0, max_verify_rows: int = 0
) -> list[StepShape]:
    """Every shape a step can take: decode-only, then mixed, then verify shapes (with num_speculative_tokens k > 0,
    for up to max_verify_rows sequences), each kind small to large."""
    max_rows = min(max_num_seqs, max_num_batched_tokens)  # the most sequences a step can hold
    sample_rows = sorted({1} | set(powers_of_two(MIN_SAMPLE_ROWS, max_rows, factor=4)))
    decode_sizes = sorted({1} | set(powers_of_two(MIN_DECODE_BUCKET, max_rows)))
    decode_sizes = sorted(set(decode_sizes) | {t * 3 // 2 for t in DECODE_HALF_STEPS if t * 3 // 2 < max_rows})
    decode = [StepShape(t, t, bucket_for(t, sample_rows), 1) for t in decode_sizes]
    mixed = [
        StepShape(t, min(t, max_num_seqs), bucket_for(min(t, max_num_seqs), sample_rows), 0)
        for t in powers_of_two(MIN_MIXED_BUCKET, max_num_batched_tokens, factor=4)
    ]
    rows = min(SMALL_MIXED_ROWS, max_num_seqs)
    small = [t for t in SMALL_MIXED_TOKENS if t < mixed[0].num_tokens]
    mixed = [StepShape(t, rows, bucket_for(rows, sample_rows), 0) for t in small] + mixed
    q_len = num_speculative_tokens + 1
    verify = []
    if num_speculative_tokens and max_verify_rows:
        verify = [StepShape(s * q_len, s, s, q_len) for s in powers_of_two(1, min(max_verify_rows, max_rows))]
    return decode + mixed + verify
