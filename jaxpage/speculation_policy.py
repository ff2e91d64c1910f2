"""When speculation pays: whether a step verifies its drafts or decodes plainly (host side, no jax).

A verify step gives each sequence 1 + (its accepted draft tokens) tokens, a plain decode step 1; the verify step
costs more, by how much depends on the batch and the device (on this CPU about the same as a decode step at batch
1, 1.8x at batch 16; on an accelerator little more at any batch). So the engine verifies when

    expected tokens of the verify step / its seconds  >=  sequences / seconds of the decode step,

expected tokens being the number of sequences plus, for each draft, its length times its sequence's acceptance
rate. Both sides are measured as the engine runs:
  - step seconds: a moving average per step shape (observe_step), the device time of the step;
  - acceptance: a moving average per sequence of accepted / drafted tokens (observe_draft), starting from the
    running average over all sequences, which starts optimistic (1).
A step shape not measured yet is tried first: the verify shape, then the decode shape. When drafting does not
pay, the estimates are refreshed by verifying anyway once in a while: after EXPLORE_AFTER (64) declined steps, then
twice as many after each try that still does not pay (up to MAX_EXPLORE_AFTER), back to EXPLORE_AFTER once it
pays. Sequences whose drafts are rarely accepted thus stop being verified, and a batch too large for verification
to pay stops drafting, by themselves.
"""

from __future__ import annotations

from collections.abc import Hashable

SEQ_ALPHA = 0.3  # weight of a sequence's latest draft in its acceptance average
PRIOR_ALPHA = 0.2  # weight of any draft in the average over all sequences (new sequences start from it)
STEP_ALPHA = 0.2  # weight of a step's latest seconds in its shape's average
EXPLORE_AFTER = 64
MAX_EXPLORE_AFTER = 1024


class SpeculationPolicy:
    def __init__(self):
        self.prior = 1.0  # acceptance rate of a sequence with no draft verified yet
        self._acceptance: dict[int, float] = {}  # by seq_id
        self._step_seconds: dict[Hashable, float] = {}  # by step shape
        self._declined = 0  # steps declined since the last verify step
        self._explore_after = EXPLORE_AFTER
        self.num_declined = 0  # steps with drafts that decoded plainly instead (all time)

    def acceptance(self, seq_id: int) -> float:
        return self._acceptance.get(seq_id, self.prior)

    def expected_tokens(self, num_seqs: int, drafts: dict[int, list[int]]) -> float:
        return num_seqs + sum(len(draft) * self.acceptance(seq_id) for seq_id, draft in drafts.items())

    def should_verify(self, num_seqs: int, drafts: dict[int, list[int]], verify_shape, decode_shape) -> bool:
        """Whether a step of num_seqs sequences should verify `drafts` (by seq_id) in `verify_shape` rather than
        decode in `decode_shape`."""
        if not drafts:
            return False
        verify_s = self._step_seconds.get(verify_shape)
        decode_s = self._step_seconds.get(decode_shape)
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

    def observe_step(self, shape, seconds: float) -> None:
        previous = self._step_seconds.get(shape)
        self._step_seconds[shape] = seconds if previous is None else previous + STEP_ALPHA * (seconds - previous)

    def observe_draft(self, seq_id: int, num_draft_tokens: int, num_accepted: int) -> None:
        rate = num_accepted / num_draft_tokens
        self.prior += PRIOR_ALPHA * (rate - self.prior)
        previous = self._acceptance.get(seq_id)
        self._acceptance[seq_id] = rate if previous is None else previous + SEQ_ALPHA * (rate - previous)

    def forget(self, seq_id: int) -> None:
        """The sequence ended."""
        self._acceptance.pop(seq_id, None)
