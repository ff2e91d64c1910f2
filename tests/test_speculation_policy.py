"""The speculation policy: verify when the measured step times and acceptance say it pays, decode plainly when not,
and try the other arm again now and then, less often while the decision holds; warm-up steps not counted, noisy
steps outvoted, every turn visible. The workloads below are simulated with injected step times (no jax)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpage.spec_decode.drafter import Draft
from jaxpage.spec_decode.policy import (
    MAX_REPROBE_AFTER,
    MIN_SAMPLES,
    PROBE_STEPS,
    REPROBE_AFTER,
    WARMUP_STEPS,
    SpeculationPolicy,
)
from jaxpage.worker.step_shapes import StepShape


def verify_shape(rows: int, k: int = 3) -> StepShape:
    return StepShape(rows * (k + 1), rows, rows, k + 1)


def decode_shape(rows: int) -> StepShape:
    return StepShape(rows, rows, rows, 1)


VERIFY, DECODE = verify_shape(16), decode_shape(16)


def observe(policy: SpeculationPolicy, shape: StepShape, seconds: float, steps: int = WARMUP_STEPS + MIN_SAMPLES):
    """Enough steps of `shape` for its estimate to count (the first ones are warm-up)."""
    for _ in range(steps):
        policy.observe_step(shape, seconds)


def measured(verify_s: float, decode_s: float) -> SpeculationPolicy:
    policy = SpeculationPolicy()
    observe(policy, VERIFY, verify_s)
    observe(policy, DECODE, decode_s)
    return policy


def draft(length: int, kind: int = 1) -> Draft:
    return Draft(list(range(length)), kind)


def test_the_verify_step_is_measured_first_then_the_decode_step():
    policy = SpeculationPolicy()
    drafts = {0: draft(3)}
    assert not policy.should_verify(1, {}, VERIFY, DECODE)  # nothing to verify
    assert policy.should_verify(1, drafts, VERIFY, DECODE)
    policy.observe_step(VERIFY, 0.2, compiled=True)  # compile time: never counted
    observe(policy, VERIFY, 0.2, WARMUP_STEPS + MIN_SAMPLES - 1)
    assert policy.should_verify(1, drafts, VERIFY, DECODE)  # one step short of enough
    policy.observe_step(VERIFY, 0.2)
    assert not policy.should_verify(1, drafts, VERIFY, DECODE)
    observe(policy, DECODE, 0.1)
    assert policy.should_verify(1, drafts, VERIFY, DECODE)  # acceptance starts optimistic: 1 + 3 tokens for 2x


def test_an_unmeasured_shape_costs_what_the_nearest_larger_measured_one_does():
    policy = measured(verify_s=0.3, decode_s=0.1)
    observe(policy, verify_shape(4), 0.2)
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


# ----- workloads simulated with injected step times: one sequence drafting 8 tokens a step (batch 1, k = 8) -----

V1, D1 = verify_shape(1, k=8), decode_shape(1)


@dataclasses.dataclass(frozen=True)
class Workload:
    verify_s: float  # a verify step's seconds
    decode_s: float  # a decode step's
    accepted: int  # draft tokens (of 8) a verify step keeps


PAYS = Workload(verify_s=0.036, decode_s=0.030, accepted=3)  # 4 tokens for 1.2x the time: 3.3x plain decoding
POOR = Workload(verify_s=0.060, decode_s=0.030, accepted=0)  # 1 token for 2x the time: 0.5x


def run(policy: SpeculationPolicy, workload: Workload, steps: int, slow=(), first: int = 0) -> tuple[list[bool], float]:
    """`steps` steps (numbered from `first`) of `workload`; those numbered in `slow` take 10x as long (a noisy
    machine), or, `slow` a function, those for which slow(step number, whether it verifies) is true. Returns
    (whether each step verified, the speed-up over plain decoding: tokens per second against 1 / decode_s)."""
    verified, seconds, tokens = [], 0.0, 0
    for i in range(first, first + steps):
        verify = policy.should_verify(1, {0: draft(8)}, V1, D1)
        is_slow = slow(i, verify) if callable(slow) else i in slow
        step_s = (workload.verify_s if verify else workload.decode_s) * (10.0 if is_slow else 1.0)
        policy.observe_step(V1 if verify else D1, step_s)
        if verify:
            policy.observe_draft(0, 1, 8, workload.accepted)
        seconds += step_s
        tokens += 1 + verify * workload.accepted
        verified.append(verify)
    return verified, tokens / seconds * workload.decode_s


def probes(verified: list[bool]) -> list[tuple[int, int]]:
    """(steps since the previous run of the other arm, length) of each run of verify steps."""
    runs, gap, length = [], 0, 0
    for v in verified:
        if v:
            length += 1
            continue
        if length:
            runs.append((gap, length))
            gap, length = 0, 0
        gap += 1
    return runs + ([(gap, length)] if length else [])


def bursts():
    """Up to 4 bursts of 1-4 steps 10x as slow, at least 12 steps apart, after the first measurements."""
    gaps = st.lists(st.tuples(st.integers(12, 80), st.integers(1, 4)), max_size=4)

    def steps(pairs):
        slow, at = set(), 12
        for gap, length in pairs:
            slow |= set(range(at, at + length))
            at += length + gap
        return slow

    return gaps.map(steps)


@settings(max_examples=50, deadline=None)
@given(bursts())
def test_speculation_that_pays_stays_on_through_noisy_steps(slow):
    policy = SpeculationPolicy()
    verified, speedup = run(policy, PAYS, 400, slow)
    assert policy.speculating and policy.num_switches_off == 0, slow
    assert sum(verified[20:]) >= 0.9 * len(verified[20:]), slow  # the decode arm's probes take the rest
    assert speedup >= 2.2, (slow, speedup)  # out of 3.3 (the slow steps cost up to 0.5 of it)


def test_warm_up_and_compile_time_are_not_counted():
    policy = SpeculationPolicy()
    policy.observe_step(V1, 50.0, compiled=True)  # compiled its program
    policy.observe_step(V1, 5.0)  # the shape's first run
    policy.observe_step(D1, 5.0, compiled=True)
    verified, speedup = run(policy, PAYS, 100, slow={1})
    assert all(verified[:MIN_SAMPLES]) and not any(verified[MIN_SAMPLES : MIN_SAMPLES + WARMUP_STEPS + MIN_SAMPLES])
    assert policy.speculating and policy.num_switches_off == 0 and speedup >= 2.5


def test_speculation_that_does_not_pay_turns_off_and_stays_off(log_records):
    policy = SpeculationPolicy()
    verified, speedup = run(policy, POOR, 500)
    assert not policy.speculating and policy.num_switches_off == 1 and policy.num_switches_on == 0
    assert sum(verified[50:]) <= 0.1 * len(verified[50:])  # the probes of the verify arm
    assert speedup >= 0.9
    (line,) = [r.getMessage() for r in log_records if "speculative decoding" in r.getMessage()]
    assert line.startswith("speculative decoding off: 2 of the latest 16 steps with drafts pay; the latest: 1 seq")
    assert "verify verify(T=9, S=1, R=1, k=8) 60.00 ms (median of " in line
    assert "decode(T=1, S=1, R=1) 30.00 ms (median of " in line and "= 30.00 ms/token" in line


def test_the_other_arm_is_probed_less_and_less_often_while_the_decision_holds():
    policy = SpeculationPolicy()
    verified, _ = run(policy, POOR, 1500)
    runs = probes(verified)
    assert runs[0] == (0, WARMUP_STEPS + MIN_SAMPLES)  # the verify shape measured first, then the decode shape
    assert runs[1][0] == WARMUP_STEPS + MIN_SAMPLES  # a few decisions to verify (acceptance starts optimistic)
    later = runs[2:]
    assert all(length == PROBE_STEPS for _, length in later)
    gaps = [gap for gap, _ in later]
    assert gaps[:4] == [REPROBE_AFTER, 2 * REPROBE_AFTER, 4 * REPROBE_AFTER, 8 * REPROBE_AFTER]
    assert gaps == sorted(gaps) and gaps[-1] == MAX_REPROBE_AFTER
    assert policy.num_probes == len(later)


def test_after_turning_off_it_turns_on_again_when_the_workload_pays():
    policy = SpeculationPolicy()
    run(policy, POOR, 600)
    assert not policy.speculating
    verified, _ = run(policy, PAYS, 400, first=600)
    turned_on = next(i for i in range(len(verified)) if all(verified[i : i + 20]))
    assert turned_on <= MAX_REPROBE_AFTER + PROBE_STEPS
    assert policy.speculating and policy.num_switches_on == 1
    assert sum(verified[-100:]) >= 90


def test_a_first_measurement_under_load_is_revisited():
    """The verify step is first measured while the machine is busy (10x), the decode step once it is quiet again:
    speculation turns off, and on again once a probe sees the machine quiet; the run keeps most of its gain."""
    policy = SpeculationPolicy()
    verified, speedup = run(policy, PAYS, 400, slow=lambda i, verify: verify and i < WARMUP_STEPS + MIN_SAMPLES)
    assert policy.num_switches_off == 1 and policy.num_switches_on == 1 and policy.speculating
    assert verified.index(True, WARMUP_STEPS + MIN_SAMPLES) <= 2 * (WARMUP_STEPS + MIN_SAMPLES) + REPROBE_AFTER
    assert speedup >= 2.3


def test_the_state_says_what_it_decides_and_why():
    policy = SpeculationPolicy()
    run(policy, POOR, 100)
    state = policy.state()
    assert not state.speculating and (state.num_switches_on, state.num_switches_off) == (0, 1)
    assert state.num_probes >= 1 and state.num_declined > 50
    assert abs(state.decode_s_per_token - 0.030) < 1e-9 and state.verify_s_per_token > 0.030
    assert 0.0 <= state.acceptance_rate < 0.1


def test_metrics_show_the_policy():
    from prometheus_client import CollectorRegistry, generate_latest

    from jaxpage.entrypoints.metrics import EngineCounts, EngineGauges
    from jaxpage.spec_decode.stats import SpecDecodingStats

    policy = SpeculationPolicy()
    run(policy, POOR, 100)
    gauges = EngineGauges(0, 0, 0.0, (0, 0), SpecDecodingStats(8), policy.state(), None, None)  # no host tier
    registry = CollectorRegistry()
    registry.register(EngineCounts(lambda: gauges))
    text = generate_latest(registry).decode()
    assert "jaxpage:spec_decode_speculating 0.0" in text
    assert 'jaxpage:spec_decode_num_switches_total{to="off"} 1.0' in text
    assert 'jaxpage:spec_decode_num_switches_total{to="on"} 0.0' in text
    assert "jaxpage:spec_decode_decode_seconds_per_token 0.03" in text
    assert "jaxpage:spec_decode_verify_seconds_per_token" in text


@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 16), st.integers(0, 16)), min_size=1, max_size=50))
def test_acceptance_stays_a_rate(observations):
    policy = SpeculationPolicy()
    for kind, drafted, accepted in observations:
        policy.observe_draft(7, kind, drafted, min(accepted, drafted))
        for k in range(5):
            assert 0.0 <= policy.acceptance(7, k) <= 1.0 and 0.0 <= policy.kind_rate(k) <= 1.0
        assert 0.0 <= policy.prior <= 1.0
