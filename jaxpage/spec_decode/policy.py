"""When speculation pays: whether a step verifies its drafts or decodes plainly (host side, no jax).

A verify step gives each sequence 1 + (its accepted draft tokens) tokens, a plain decode step 1; the verify step
costs more, by how much depends on the batch and the device (on this CPU 1.0-1.3x a decode step at batch 1, about
3x at batch 16; on an accelerator little more at any batch). So the engine verifies when

    expected tokens of the verify step / its seconds  >=  sequences / seconds of the decode step,

expected tokens being the number of sequences plus, for each draft, its length times its expected acceptance.
Both are measured as the engine runs:
  - step seconds: a moving average per step shape (observe_step), the device time of the step;
  - acceptance of a draft of kind c (the n-gram match length; one kind for a draft model) from sequence s:
        rate(c) * (accepted(s) + PSEUDO_TOKENS) / (expected(s) + PSEUDO_TOKENS), at most 1,
    rate(c) being the moving average of accepted / drafted tokens over every sequence's drafts of kind c (starting
    from the average over all kinds, which starts optimistic, at 1), and accepted(s) / expected(s) how this
    sequence has done against those rates (decaying sums of its accepted tokens and of what the rates predicted):
    a sequence that copies its prompt does better than the rates, open-ended text worse. The pseudo-tokens keep a
    sequence's first drafts close to the rates, and the sums' decay lets it change course.
    Why this estimate: on the benchmark's workloads, acceptance depends most on the match length (drafts after a
    4-token match kept about 6 of 8 tokens, after a 1-token match under 1), then on the task; a per-sequence
    moving average alone fell below break-even after a handful of failed drafts during copying and stopped
    verifying drafts that paid (batch 1: 1.77x against 2.27x for verifying every draft).
A shape not measured yet is taken to cost what the nearest larger measured shape of its kind costs (an
over-estimate: a batch that shrinks is not made to try each smaller verify shape, which for a draft model means
catching up on every sequence's tokens first); with none measured, it is tried first: the verify shape, then the
decode shape. When drafting does not
pay, the estimates are refreshed by verifying anyway once in a while: after EXPLORE_AFTER (64) declined steps, then
twice as many after each try that still does not pay (up to MAX_EXPLORE_AFTER), back to EXPLORE_AFTER once it
pays. Sequences whose drafts are rarely accepted thus stop being verified, and a batch too large for verification
to pay stops drafting, by themselves.
"""

from __future__ import annotations

from collections.abc import Mapping

from jaxpage.spec_decode.drafter import Draft
from jaxpage.worker.step_shapes import StepShape

PRIOR_ALPHA = 0.2  # weight of any draft in the average over all kinds (kinds not seen yet start from it)
KIND_ALPHA = 0.1  # weight of a draft in its kind's average
SEQ_DECAY = 0.8  # a sequence's sums of accepted and expected tokens decay by this at each of its drafts
PSEUDO_TOKENS = 8.0  # pulls a sequence's accepted / expected towards 1
STEP_ALPHA = 0.2  # weight of a step's latest seconds in its shape's average
EXPLORE_AFTER = 64
MAX_EXPLORE_AFTER = 1024


class SpeculationPolicy:
    def __init__(self):
        self.prior = 1.0  # acceptance rate of a kind of draft not verified yet
        self._kind_rate: dict[int, float] = {}
        self._accepted: dict[int, float] = {}  # by seq_id: decaying sum of accepted draft tokens
        self._expected: dict[int, float] = {}  # by seq_id: decaying sum of what the kind rates predicted
        self._step_seconds: dict[StepShape, float] = {}
        self._declined = 0  # steps declined since the last verify step
        self._explore_after = EXPLORE_AFTER
        self.num_declined = 0  # steps with drafts that decoded plainly instead (all time)

    def kind_rate(self, kind: int) -> float:
        return self._kind_rate.get(kind, self.prior)

    def acceptance(self, seq_id: int, kind: int) -> float:
        """The expected share of accepted tokens in a draft of `kind` from sequence seq_id."""
        ratio = (self._accepted.get(seq_id, 0.0) + PSEUDO_TOKENS) / (self._expected.get(seq_id, 0.0) + PSEUDO_TOKENS)
        return min(1.0, self.kind_rate(kind) * ratio)

    def expected_tokens(self, num_seqs: int, drafts: Mapping[int, Draft]) -> float:
        return num_seqs + sum(len(d.token_ids) * self.acceptance(seq_id, d.kind) for seq_id, d in drafts.items())

    def should_verify(
        self, num_seqs: int, drafts: Mapping[int, Draft], verify_shape: StepShape, decode_shape: StepShape
    ) -> bool:
        """Whether a step of num_seqs sequences should verify `drafts` (by seq_id) in `verify_shape` rather than
        decode in `decode_shape`."""
        if not drafts:
            return False
        verify_s, decode_s = self._seconds(verify_shape), self._seconds(decode_shape)
        if verify_s is None or decode_s is None:
            return verify_s is None  # measure the verify step first, then the decode step
        if self.expected_tokens(num_seqs, drafts) * decode_s >= num_seqs * verify_s:
            self._declined = 0
            self._explore_after = EXPLORE_AFTER
            return True
        self._declined += 1
        if self._declined >= self._explore_after:  # refresh the estimates; wait longer before the next try
            self._declined = 0
            self._explore_after = min(2 * self._explore_after, MAX_EXPLORE_AFTER)
            return True
        self.num_declined += 1
        return False

    def _seconds(self, shape: StepShape) -> float | None:
        """The shape's measured seconds, else the nearest larger measured shape's of its kind (and k), else None."""
        if shape in self._step_seconds:
            return self._step_seconds[shape]
        larger = [s for s in self._step_seconds if s.max_q_len == shape.max_q_len and s > shape]
        return self._step_seconds[min(larger)] if larger else None

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        previous = self._step_seconds.get(shape)
        self._step_seconds[shape] = seconds if previous is None else previous + STEP_ALPHA * (seconds - previous)

    def observe_draft(self, seq_id: int, kind: int, num_draft_tokens: int, num_accepted: int) -> None:
        rate, kind_rate = num_accepted / num_draft_tokens, self.kind_rate(kind)
        self._accepted[seq_id] = SEQ_DECAY * self._accepted.get(seq_id, 0.0) + num_accepted
        self._expected[seq_id] = SEQ_DECAY * self._expected.get(seq_id, 0.0) + num_draft_tokens * kind_rate
        self._kind_rate[kind] = kind_rate + KIND_ALPHA * (rate - kind_rate)
        self.prior += PRIOR_ALPHA * (rate - self.prior)

    def forget(self, seq_id: int) -> None:
        """The sequence ended."""
        self._accepted.pop(seq_id, None)
        self._expected.pop(seq_id, None)
