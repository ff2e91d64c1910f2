"""The speculation policy: verify when the measured step times and acceptance say it pays, decode plainly when not,
and try again now and then, less often while it keeps not paying."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from jaxpage.spec_decode.drafter import Draft
from jaxpage.spec_decode.policy import EXPLORE_AFTER, MAX_EXPLORE_AFTER, SpeculationPolicy
from jaxpage.worker.step_shapes import StepShape


def verify_shape(rows: int, k: int = 3) -> StepShape:
    return StepShape(rows * (k + 1), rows, rows, k + 1)


def decode_shape(rows: int) -> StepShape:
    return StepShape(rows, rows, rows, 1)


VERIFY, DECODE = verify_shape(16), decode_shape(16)


def measured(verify_s: float, decode_s: float) -> SpeculationPolicy:
    policy = SpeculationPolicy()
    policy.observe_step(VERIFY, verify_s)
    policy.observe_step(DECODE, decode_s)
    return policy


def draft(length: int, kind: int = 1) -> Draft:
    return Draft(list(range(length)), kind)


def test_the_verify_step_is_measured_first_then_the_decode_step():
    policy = SpeculationPolicy()
    drafts = {0: draft(3)}
    assert not policy.should_verify(1, {}, VERIFY, DECODE)  # nothing to verify
    assert policy.should_verify(1, drafts, VERIFY, DECODE)
    policy.observe_step(VERIFY, 0.2)
    assert not policy.should_verify(1, drafts, VERIFY, DECODE)
    policy.observe_step(DECODE, 0.1)
    assert policy.should_verify(1, drafts, VERIFY, DECODE)  # acceptance starts optimistic: 1 + 3 tokens for 2x


def test_an_unmeasured_shape_costs_what_the_nearest_larger_measured_one_does():
    policy = measured(verify_s=0.3, decode_s=0.1)
    policy.observe_step(verify_shape(4), 0.2)
    policy._kind_rate[1] = 0.5
    # The batch shrank to 2: verify(S=2) is taken to cost verify(S=4)'s 0.2 s, decode(S=2) decode(S=16)'s 0.1 s, so
    # drafts of 1 token (2 + 2 * 0.5 = 3 tokens for 0.2 s against 2 for 0.1 s) do not pay, drafts of 3 do.
    assert not policy.should_verify(2, {0: draft(1), 1: draft(1)}, verify_shape(2), decode_shape(2))
    assert policy.should_verify(2, {0: draft(3), 1: draft(3)}, verify_shape(2), decode_shape(2))
    # Nothing larger measured (another k): measure it first.
    assert policy.should_verify(2, {0: draft(1)}, verify_shape(2, k=8), decode_shape(2))


def test_verify_when_the_expected_tokens_pay_for_the_longer_step():
    policy = measured(verify_s=0.3, decode_s=0.1)  # verify costs 3 decode steps
    policy._kind_rate[1] = 0.5
    assert policy.acceptance(0, kind=1) == 0.5  # a sequence with no drafts yet: its kind's rate
    # 4 sequences: 4 + 4 * 4 * 0.5 = 12 tokens for 0.3 s against 4 tokens for 0.1 s: equal, so verify.
    assert policy.should_verify(4, {i: draft(4) for i in range(4)}, VERIFY, DECODE)
    # Drafts of one token: 4 + 4 * 0.5 = 6 tokens for 0.3 s: decode.
    assert not policy.should_verify(4, {i: draft(1) for i in range(4)}, VERIFY, DECODE)
    # Two of the four sequences draft: 4 + 2 * 4 * 0.5 = 8: decode.
    assert not policy.should_verify(4, {0: draft(4), 1: draft(4)}, VERIFY, DECODE)


def test_each_kind_of_draft_has_its_own_rate():
    policy = SpeculationPolicy()
    for seq_id in range(40):  # long n-gram matches are kept, short ones not
        policy.observe_draft(seq_id, 4, 8, 8)
        policy.observe_draft(seq_id, 1, 8, 0)
    assert policy.kind_rate(4) > 0.95 and policy.kind_rate(1) < 0.05
    # A sequence that does as its kinds predict keeps their rates.
    assert abs(policy.acceptance(39, 4) - policy.kind_rate(4)) < 0.1
    assert policy.acceptance(39, 1) < 0.05
    # A kind not seen yet starts from the average over all drafts.
    assert policy.acceptance(99, 2) == policy.prior


def test_a_sequence_that_beats_its_kinds_rates_is_expected_to_go_on_doing_so():
    policy = SpeculationPolicy()
    policy._kind_rate[1] = 0.2
    for _ in range(6):
        policy.observe_draft(0, 1, 8, 8)  # sequence 0 copies: every draft kept
        policy.observe_draft(1, 1, 8, 0)  # sequence 1 does not
    assert policy.acceptance(0, 1) > 1.5 * policy.kind_rate(1)
    assert policy.acceptance(1, 1) < 0.6 * policy.kind_rate(1)


def test_sequences_whose_drafts_fail_stop_counting():
    policy = measured(verify_s=0.15, decode_s=0.1)
    drafts = {0: draft(3)}
    for _ in range(20):
        policy.observe_draft(0, 1, 3, 0)
    assert policy.acceptance(0, 1) < 0.1  # 1 + 3 * 0.1 tokens for 1.5x the time: decode
    assert not policy.should_verify(1, drafts, VERIFY, DECODE)
    policy.forget(0)
    assert policy.acceptance(0, 1) == policy.kind_rate(1)


def test_declined_steps_try_again_less_and_less_often():
    policy = measured(verify_s=1.0, decode_s=0.1)  # never pays
    drafts = {0: draft(1)}
    for seq_id in range(100):
        policy.observe_draft(seq_id, 1, 1, 0)
    tries = [i for i in range(5000) if policy.should_verify(1, drafts, VERIFY, DECODE)]
    gaps = [b - a for a, b in zip([-1, *tries], tries, strict=False)]
    assert gaps[0] == EXPLORE_AFTER
    assert gaps == sorted(gaps) and gaps[1] == 2 * EXPLORE_AFTER and gaps[-1] == MAX_EXPLORE_AFTER
    assert policy.num_declined == 5000 - len(tries)


def test_a_step_that_pays_resets_the_wait():
    policy = measured(verify_s=1.0, decode_s=0.1)
    policy.observe_draft(0, 1, 1, 0)
    drafts = {0: draft(1)}
    for _ in range(3 * EXPLORE_AFTER):
        policy.should_verify(1, drafts, VERIFY, DECODE)
    for _ in range(21):  # verification became as cheap as decoding; the moving average follows
        policy.observe_step(VERIFY, 0.1)
    assert policy.should_verify(1, {0: draft(1), 1: draft(1)}, VERIFY, DECODE)
    policy.observe_step(VERIFY, 10.0)
    declined = [not policy.should_verify(1, drafts, VERIFY, DECODE) for _ in range(EXPLORE_AFTER)]
    assert declined == [True] * (EXPLORE_AFTER - 1) + [False]  # back to the first wait


@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 16), st.integers(0, 16)), min_size=1, max_size=50))
def test_acceptance_stays_a_rate(observations):
    policy = SpeculationPolicy()
    for kind, drafted, accepted in observations:
        policy.observe_draft(7, kind, drafted, min(accepted, drafted))
        for k in range(5):
            assert 0.0 <= policy.acceptance(7, k) <= 1.0 and 0.0 <= policy.kind_rate(k) <= 1.0
        assert 0.0 <= policy.prior <= 1.0
