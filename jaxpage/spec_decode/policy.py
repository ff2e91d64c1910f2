"""When speculation pays: whether a step verifies its drafts or decodes plainly (host side, no jax).

A verify step gives each sequence 1 + (its accepted draft tokens) tokens, a plain decode step 1; the verify step
costs more, by how much depends on the batch and the device (on this CPU 1.0-1.3x a decode step at batch 1, about
3x at batch 16; on an accelerator little more at any batch). Like is compared with like, at the step shapes of the
same batch: the engine verifies when the verify step's seconds per token it is expected to give are at most the
decode step's seconds per token,

    verify seconds / expected tokens  <=  decode seconds / sequences,

expected tokens being the number of sequences plus, for each draft, its length times its expected acceptance.
Both are measured as the engine runs:
  - step seconds, per step shape: the median of its last WINDOW usable steps (observe_step), robust to a few steps
    slowed by whatever else runs on the machine. Not usable, as warm-up: any step that compiled or loaded a program
    (the caller says so), then a shape's first WARMUP_STEPS steps (first-run costs). A shape's estimate counts once it
    has MIN_SAMPLES usable steps; until then it is measured first (the verify shape, then the decode shape), unless
    a larger measured shape of its kind (and k) stands in for it: an over-estimate, so that a batch that shrinks is
    not made to try each smaller verify shape (for a draft model that means catching up on every sequence's tokens);
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
The decision is revisited as the workload and the machine's load change: once one arm (verify or decode) has been
taken for `reprobe_after` decisions in a row, the other is probed for PROBE_STEPS steps, a majority of a shape's
window, so that its estimate is of now (a slow first measurement, or a load since gone, is forgotten after one
probe). `reprobe_after` starts at REPROBE_AFTER, doubles after each probe that leaves the decision as it was, up to
MAX_REPROBE_AFTER, and starts again when the decision changes: a decision to stop verifying is never permanent, and
costs at most PROBE_STEPS in MAX_REPROBE_AFTER steps while it holds.
Whether the policy speculates (`speculating`) follows its decisions: it turns off when at most SWITCH_SHARE of the
latest SWITCH_WINDOW decisions verified, on again when at least 1 - SWITCH_SHARE did (declining the drafts of a poor
kind now and then, as the per-draft estimates ask, is no turn); each turn is logged (INFO, logger
"jaxpage") with the numbers that decided it, and `state()` gives the counters and current estimates (the engine's
stats, the server's /metrics).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
from collections.abc import Hashable, Mapping

from jaxpage.spec_decode.drafter import Draft

logger = logging.getLogger("jaxpage")

PRIOR_ALPHA = 0.2  # weight of any draft in the average over all kinds (kinds not seen yet start from it)
KIND_ALPHA = 0.1  # weight of a draft in its kind's average
SEQ_DECAY = 0.8  # a sequence's sums of accepted and expected tokens decay by this at each of its drafts
PSEUDO_TOKENS = 8.0  # pulls a sequence's accepted / expected towards 1
WARMUP_STEPS = 1  # a shape's first steps: not counted
WINDOW = 9  # a shape's seconds: the median of its last WINDOW usable steps
MIN_SAMPLES = 5  # usable steps of a shape before its median counts
PROBE_STEPS = WINDOW // 2 + 1  # steps of the other arm per probe: they decide its median
REPROBE_AFTER = 16  # decisions of one arm in a row before the other is probed (at first)
MAX_REPROBE_AFTER = 256
SWITCH_WINDOW = 16  # `speculating`: from the share of these latest decisions that verified
SWITCH_SHARE = 0.25


@dataclasses.dataclass(frozen=True)
class PolicyState:
    """What the speculation policy decides and why, for stats and metrics."""

    speculating: bool  # whether it verifies drafts now (see the module docstring)
    num_switches_on: int  # times it turned speculation on (all time)
    num_switches_off: int
    num_probes: int  # probes of the arm not taken
    num_declined: int  # steps with drafts that decoded plainly instead (all time)
    verify_s_per_token: float | None  # at the latest decision: the verify step's seconds / its expected tokens
    decode_s_per_token: float | None  # the decode step's seconds / its sequences
    acceptance_rate: float  # the average over all kinds of drafts (moving)


class StepTimes:
    """Seconds per step shape: the median of its last WINDOW usable steps (see the module docstring)."""

    def __init__(self):
        self._seen: dict[Hashable, int] = collections.Counter()  # steps per shape that compiled nothing
        self._window: dict[Hashable, collections.deque] = {}

    def observe(self, shape: Hashable, seconds: float, compiled: bool = False) -> None:
        if compiled:
            return
        self._seen[shape] += 1
        if self._seen[shape] <= WARMUP_STEPS:
            return
        self._window.setdefault(shape, collections.deque(maxlen=WINDOW)).append(seconds)

    def samples(self, shape: Hashable) -> int:
        return len(self._window.get(shape, ()))

    def own(self, shape: Hashable) -> float | None:
        """The shape's own median, None before MIN_SAMPLES usable steps."""
        window = self._window.get(shape)
        return statistics.median(window) if window is not None and len(window) >= MIN_SAMPLES else None

    def seconds(self, shape) -> float | None:
        """The shape's median, else the nearest larger measured shape's of its kind (and k), else None."""
        own = self.own(shape)
        if own is not None:
            return own
        larger = [s for s in self._window if s.max_q_len == shape.max_q_len and s > shape and self.own(s) is not None]
        return self.own(min(larger)) if larger else None


class SpeculationPolicy:
    def __init__(self):
        self.prior = 1.0  # acceptance rate of a kind of draft not verified yet
        self._kind_rate: dict[int, float] = {}
        self._accepted: dict[int, float] = {}  # by seq_id: decaying sum of accepted draft tokens
        self._expected: dict[int, float] = {}  # by seq_id: decaying sum of what the kind rates predicted
        self.step_times = StepTimes()
        self.speculating = True  # until measured otherwise
        self._pays: bool | None = None  # the latest decision
        self._decisions: collections.deque = collections.deque(maxlen=SWITCH_WINDOW)  # the latest (True: verify)
        self._streak = 0  # decisions in a row the same (since the latest probe)
        self._reprobe_after = REPROBE_AFTER
        self._probe = False  # the arm being probed (True: verify)
        self._probe_left = 0  # its steps still to come
        self._probed = False  # a probe since the latest decision
        self._per_token: tuple[float, float] | None = None  # the latest decision's seconds per token: verify, decode
        self.num_switches_on = 0
        self.num_switches_off = 0
        self.num_probes = 0
        self.num_declined = 0  # steps with drafts that decoded plainly instead (all time)

    def kind_rate(self, kind: int) -> float:
        return self._kind_rate.get(kind, self.prior)

    def acceptance(self, seq_id: int, kind: int) -> float:
        """The expected share of accepted tokens in a draft of `kind` from sequence seq_id."""
        ratio = (self._accepted.get(seq_id, 0.0) + PSEUDO_TOKENS) / (self._expected.get(seq_id, 0.0) + PSEUDO_TOKENS)
        return min(1.0, self.kind_rate(kind) * ratio)

    def expected_tokens(self, num_seqs: int, drafts: Mapping[int, Draft]) -> float:
        return num_seqs + sum(len(d.token_ids) * self.acceptance(seq_id, d.kind) for seq_id, d in drafts.items())

    def should_verify(self, num_seqs: int, drafts: Mapping[int, Draft], verify_shape, decode_shape) -> bool:
        """Whether a step of num_seqs sequences should verify `drafts` (by seq_id) in `verify_shape` (a StepShape)
        rather than decode in `decode_shape`."""
        if not drafts:
            return False
        verify_s, decode_s = self.step_times.seconds(verify_shape), self.step_times.seconds(decode_shape)
        if verify_s is None or decode_s is None:
            return self._took(verify_s is None)  # measure the verify step first, then the decode step
        if self._probe_left:
            self._probe_left -= 1
            return self._took(self._probe)
        expected = self.expected_tokens(num_seqs, drafts)
        self._per_token = (verify_s / expected, decode_s / num_seqs)
        pays = expected * decode_s >= num_seqs * verify_s
        if pays != self._pays:  # both arms are measured anyway; a changed decision is watched closely again
            self._reprobe_after, self._streak = REPROBE_AFTER, 0
        elif self._probed:  # the probe left the decision as it was: wait longer before the next
            self._reprobe_after = min(2 * self._reprobe_after, MAX_REPROBE_AFTER)
        self._pays, self._probed = pays, False
        self._turn(pays, num_seqs, expected, verify_shape, verify_s, decode_shape, decode_s)
        self._streak += 1
        if self._streak >= self._reprobe_after:  # probe the other arm from the next step on
            self._streak, self._probed = 0, True
            self._probe, self._probe_left = not pays, PROBE_STEPS
            self.num_probes += 1
        return self._took(pays)

    def _took(self, verify: bool) -> bool:
        if not verify:
            self.num_declined += 1
        return verify

    def _turn(self, pays: bool, num_seqs: int, expected: float, verify_shape, verify_s, decode_shape, decode_s):
        """`speculating` follows the share of the latest decisions that verified; each turn is logged."""
        self._decisions.append(pays)
        share = sum(self._decisions) / len(self._decisions)
        turns = share <= SWITCH_SHARE if self.speculating else share >= 1 - SWITCH_SHARE
        if len(self._decisions) < SWITCH_WINDOW or not turns:
            return
        self.speculating = not self.speculating
        if self.speculating:
            self.num_switches_on += 1
        else:
            self.num_switches_off += 1
        times = self.step_times
        logger.info(
            "speculative decoding %s: %d of the latest %d steps with drafts pay; the latest: %d sequences, verify %s "
            "%.2f ms (median of %d steps) for %.2f expected tokens = %.2f ms/token, decode %s %.2f ms (median of %d) "
            "= %.2f ms/token; acceptance rate %.2f",
            "on" if self.speculating else "off",
            sum(self._decisions),
            len(self._decisions),
            num_seqs,
            verify_shape,
            1e3 * verify_s,
            times.samples(verify_shape),
            expected,
            1e3 * verify_s / expected,
            decode_shape,
            1e3 * decode_s,
            times.samples(decode_shape),
            1e3 * decode_s / num_seqs,
            self.prior,
        )

    def state(self) -> PolicyState:
        verify, decode = self._per_token if self._per_token is not None else (None, None)
        return PolicyState(
            self.speculating,
            self.num_switches_on,
            self.num_switches_off,
            self.num_probes,
            self.num_declined,
            verify,
            decode,
            self.prior,
        )

    def observe_step(self, shape, seconds: float, compiled: bool = False) -> None:
        """A step of `shape` (a StepShape) took `seconds` on the device; compiled: it compiled or loaded a program."""
        self.step_times.observe(shape, seconds, compiled)

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
