"""Asynchronous scheduling (LLMEngine.step, Scheduler.launched): the next step is scheduled and launched before the
tokens of the step on the device are known, and the outputs are those of synchronous scheduling.

The engine: the same workload through a synchronous and an asynchronous engine of the tiny model (greedy and seeded
sampling, n > 1, EOS, stop token ids and strings, log-probs, logits processors, preemption, an abort mid-stream, data
parallelism) gives the same outputs, and nothing compiles after the warm-up. Speculative decoding is refused with it.

Host side: a state machine runs the scheduler the way the asynchronous engine does, with a fake device whose tokens
depend only on a sequence and a position (so every sequence's output is known in advance, whatever the schedule):
steps launched one ahead of their updates, or drained first (as the engine does for logits processors), with
preemptions, aborts and host-side ends (stop strings) in between.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_scheduler import PAGE_SIZE, make_group

from jaxpage.config import EngineConfig, SchedulerConfig
from jaxpage.engine.block_manager import BlockManager
from jaxpage.engine.scheduler import Scheduler
from jaxpage.engine.step_pipeline import use_async_scheduling
from jaxpage.entrypoints.llm import LLM
from jaxpage.sampling_params import SamplingParams
from jaxpage.sequence import Sequence, SequenceStatus

EOS = 0
MAX_MODEL_LEN = 40
NUM_PAGES = 12


def true_token(seq: Sequence, pos: int) -> int:
    """The token at position `pos` of seq, as the fake device samples it: its prompt's, then a function of the
    sequence and the position alone (EOS now and then; siblings differ)."""
    if pos < seq.num_prompt_tokens:
        return seq.prompt_token_ids[pos]
    return (seq.seq_id * 7 + pos * 3) % 23


def kv_of(seq: Sequence, pos: int) -> tuple[int, ...]:
    """What the K/V of token `pos` of seq depends on: its true tokens up to it."""
    return tuple(true_token(seq, p) for p in range(pos + 1))


def expected_output(seq: Sequence, max_out: int) -> list[int]:
    """What any schedule must give seq: its true tokens up to EOS, max_tokens, max_model_len, or max_out (ended on the
    host, as a stop string ends it), whichever comes first."""
    out = []
    limit = min(seq.sampling_params.max_tokens or max_out, max_out, MAX_MODEL_LEN - seq.num_prompt_tokens)
    for pos in range(seq.num_prompt_tokens, seq.num_prompt_tokens + limit):
        out.append(true_token(seq, pos))
        if out[-1] == EOS:
            break
    return out


class AsyncSchedulerMachine(RuleBasedStateMachine):
    """The scheduler as the asynchronous engine drives it. `pool` plays the device, in launch order: a step reads
    the K/V of its sequences' computed tokens (what attention reads must be the true tokens' K/V, although the host
    may not know them yet) and writes those of its new tokens."""

    def __init__(self):
        super().__init__()
        config = SchedulerConfig(4, 16, MAX_MODEL_LEN, frozenset({EOS}))
        self.scheduler = Scheduler(config, BlockManager(NUM_PAGES, PAGE_SIZE, True))
        self.pool = [[None] * PAGE_SIZE for _ in range(NUM_PAGES)]
        self.in_flight = None  # (the launched step's SchedulerOutput, the tokens the device sampled)
        self.max_out: dict[int, int] = {}
        self.seqs: list[Sequence] = []
        self.aborted: set[int] = set()
        self.next_id = 0

    @rule(
        prompt_len=st.integers(1, 24),
        shared=st.booleans(),
        max_outs=st.lists(st.integers(1, 14), min_size=1, max_size=3),
        max_tokens=st.one_of(st.none(), st.integers(1, 10)),
    )
    def add(self, prompt_len, shared, max_outs, max_tokens):
        prompt = [(i % 5) + 1 if shared else (self.next_id * 31 + i) % 97 + 1 for i in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens)
        for seq, max_out in zip(make_group(self.next_id, prompt, len(max_outs)), max_outs, strict=True):
            seq.sampling_params = params
            self.scheduler.add(seq)
            self.seqs.append(seq)
            self.max_out[seq.seq_id] = max_out
        self.next_id += len(max_outs)

    @precondition(lambda self: self.scheduler.waiting or self.scheduler.running or self.in_flight)
    @rule(drain=st.booleans())
    def step(self, drain):
        """One engine step: schedule and launch the next step, then update the one launched before (drain: update
        it first and launch nothing, as the engine does when a sequence's logits processors need its token)."""
        if drain and self.in_flight is not None:
            self._update(self.in_flight)
            self.in_flight = None
            return
        output = self.scheduler.schedule()
        if self.in_flight is None:
            assert output.scheduled or not (self.scheduler.waiting or self.scheduler.running), "nothing scheduled"
        launched = None
        if output.scheduled:
            assert output.num_batched_tokens <= self.scheduler.config.max_num_batched_tokens
            launched = (output, self._device_step(output))
            self.scheduler.launched(output)
        previous, self.in_flight = self.in_flight, launched
        if previous is not None:
            self._update(previous)

    def _device_step(self, output) -> np.ndarray:
        for (_, dst), data in zip(output.page_copies, [list(self.pool[s]) for s, _ in output.page_copies], strict=True):
            self.pool[dst] = data
        written = set()
        tokens = np.full((len(output.scheduled), 1), -1, np.int32)
        for row, item in enumerate(output.scheduled):
            seq, table = item.seq, item.seq.block_table
            assert seq.status is SequenceStatus.RUNNING and item.num_new_tokens >= 1
            end = item.num_computed_tokens + item.num_new_tokens
            assert end <= MAX_MODEL_LEN and len(table) * PAGE_SIZE >= end
            for pos in range(item.num_computed_tokens):
                assert self.pool[table[pos // PAGE_SIZE]][pos % PAGE_SIZE] == kv_of(seq, pos), pos
            for pos in range(item.num_computed_tokens, end):
                slot = (table[pos // PAGE_SIZE], pos % PAGE_SIZE)
                assert slot not in written, "two sequences write one slot"
                written.add(slot)
            if item.samples:
                tokens[row] = true_token(seq, end)
        for item in output.scheduled:
            table = item.seq.block_table
            for pos in range(item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens):
                self.pool[table[pos // PAGE_SIZE]][pos % PAGE_SIZE] = kv_of(item.seq, pos)
        return tokens

    def _update(self, launched):
        output, tokens = launched
        ended = sum(item.seq.status is SequenceStatus.FINISHED for item in output.scheduled)
        event(f"items of finished sequences thrown away: {min(ended, 2)}")
        preempted = sum(item.seq.status is SequenceStatus.WAITING for item in output.scheduled)
        event(f"items of sequences preempted since launched: {min(preempted, 1)}")
        for update in self.scheduler.update_from_output(output, tokens):
            seq = update.seq
            assert update.token_ids == [true_token(seq, seq.num_tokens - 1)]
            if seq.status is not SequenceStatus.FINISHED and len(seq.output_token_ids) >= self.max_out[seq.seq_id]:
                self.scheduler.finish(seq)  # on the host, as a stop string ends it

    @precondition(lambda self: self.scheduler.waiting or self.scheduler.running)
    @rule(index=st.integers(0, 100))
    def abort(self, index):
        live = [s for s in self.seqs if s.status is not SequenceStatus.FINISHED]
        seq = live[index % len(live)]
        for sibling in seq.group or (seq,):
            if sibling.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(sibling)
                self.aborted.add(sibling.seq_id)

    @invariant()
    def outputs_are_the_synchronous_ones(self):
        manager = self.scheduler.block_manager
        manager.check_invariants()
        assert manager.num_used_pages + manager.num_free_pages == manager.num_pages - 1
        for seq in self.seqs:
            expected = expected_output(seq, self.max_out[seq.seq_id])
            if seq.status is SequenceStatus.FINISHED and seq.seq_id not in self.aborted:
                assert seq.output_token_ids == expected
            else:  # still going, or aborted: a beginning of it
                assert seq.output_token_ids == expected[: len(seq.output_token_ids)]
            assert 0 <= seq.num_pending_tokens <= 2
            if seq.status is SequenceStatus.WAITING:
                assert not seq.block_table and seq.num_computed_tokens == 0

    def teardown(self):
        event(f"preemptions: {min(self.scheduler.num_preemptions, 1)}")
        if self.in_flight is not None:
            self._update(self.in_flight)
        for seq in self.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(seq)
            assert seq.num_pending_tokens == 0
        assert self.scheduler.block_manager.num_used_pages == 0


TestAsyncSchedulerMachine = AsyncSchedulerMachine.TestCase
TestAsyncSchedulerMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)


# ----- the engine: the same requests through a synchronous and an asynchronous engine -----

ENGINE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, page_size=8)
# 14 pages of 8 (the null page aside): fewer than the workload's sequences need at once, so some are preempted
SMALL_POOL = dict(ENGINE, num_pages=14)
PROMPTS = [[5, 9, 13, 2, 40], list(range(10, 50)), [77], [(7 * i) % 90 + 3 for i in range(23)], [3, 1, 4, 1, 5]]


def workload() -> list[tuple[dict, SamplingParams]]:
    """Requests that touch what a step's tokens decide: greedy and seeded sampling (n > 1 among them), EOS, lengths,
    log-probs, stop token ids, and logits processors (penalties, biases, bad words: the engine waits for the tokens
    before the step after theirs)."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=11, max_tokens=20, n=2)
    eos = SamplingParams(temperature=1.2, seed=5, max_tokens=40)  # ends at EOS or its length
    stops = SamplingParams(temperature=0.8, seed=3, max_tokens=30, stop_token_ids=[7, 8, 9, 10])
    controlled = SamplingParams(temperature=0.7, seed=2, max_tokens=16, repetition_penalty=1.3, logit_bias={4: 5.0})
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return list(zip(prompts, [greedy, seeded, eos, stops, controlled], strict=True))


def outputs_of(results) -> list:
    """What a request's outputs say, every field a step's tokens decide: log-probs as pytest.approx (a step's batch,
    and so its shapes, differ between the two: the last bits of a float may too)."""
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, logprobs_of(c)) for c in o.outputs] for o in results]


def logprobs_of(completion):
    if completion.logprobs is None:
        return None
    return [
        {token: (pytest.approx(lp.logprob, rel=1e-5, abs=1e-6), lp.rank) for token, lp in position.items()}
        for position in completion.logprobs
    ]


def run(llm, requests) -> list:
    prompts, params = zip(*requests, strict=True)
    return outputs_of(llm.generate(list(prompts), list(params)))


@pytest.fixture(scope="module")
def engines(tiny_dir):
    """(synchronous, asynchronous) engines of the tiny model, each with a pool small enough to preempt; the
    asynchronous one warmed up."""
    sync, asynchronous = (LLM(tiny_dir, async_scheduling=mode, **SMALL_POOL) for mode in (False, True))
    asynchronous.engine.warmup()
    return sync, asynchronous


def test_async_scheduling_gives_the_synchronous_outputs(engines):
    sync, asynchronous = engines
    assert (sync.engine.async_scheduling, asynchronous.engine.async_scheduling) == (False, True)
    compiled = asynchronous.engine.runner.num_compilations
    requests = workload()
    expected = run(sync, requests)
    assert run(asynchronous, requests) == expected
    assert sync.engine.scheduler.num_preemptions > 0 and asynchronous.engine.scheduler.num_preemptions > 0
    # Stop strings: strings the synchronous outputs hold, so that they end some requests early.
    texts = [c[1] for cs in expected for c in cs]
    stop = SamplingParams(temperature=0, max_tokens=24, stop=[texts[0][6:9], texts[2][4:6]])
    stopped = [(prompt, stop) for prompt, _ in requests]
    expected_stops = run(sync, stopped)
    assert any(c[2] == "stop" for cs in expected_stops for c in cs)
    assert run(asynchronous, stopped) == expected_stops
    assert asynchronous.engine.runner.num_compilations == compiled  # nothing compiles after the warm-up
    for llm in engines:
        assert llm.engine.block_manager.num_used_pages == 0
        llm.engine.block_manager.check_invariants()


def test_an_abort_mid_stream_leaves_the_others_as_they_were(engines):
    def stream(llm) -> tuple[dict, list]:
        engine = llm.engine
        for i, (prompt, params) in enumerate(workload()):
            engine.add_request(f"r{i}", prompt, params)
        finals, aborted_at = {}, None
        steps = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finals[output.request_id] = output
                elif output.request_id == "r1" and aborted_at is None and len(output.outputs[0].token_ids) >= 3:
                    aborted_at = len(output.outputs[0].token_ids)
                    engine.abort_request("r1")
            steps += 1
        return finals, aborted_at

    (sync, sync_abort), (asynchronous, async_abort) = (stream(llm) for llm in engines)
    assert sync_abort == async_abort == 3
    for rid in sync:
        if rid != "r1":
            assert outputs_of([asynchronous[rid]]) == outputs_of([sync[rid]])
    for finals in (sync, asynchronous):
        assert {c.finish_reason for c in finals["r1"].outputs} == {"abort"}
    # Aborted after the same output: the same tokens, the step in flight's thrown away.
    assert [c.token_ids for c in asynchronous["r1"].outputs] == [c.token_ids for c in sync["r1"].outputs]
    for llm in engines:
        assert llm.engine.block_manager.num_used_pages == 0


def test_the_first_asynchronous_step_returns_its_tokens_a_step_later(engines):
    engine = engines[1].engine
    engine.add_request("one", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=3))
    assert engine.step() == []  # launched; its tokens come with the next call
    first = engine.step()
    assert [len(o.outputs[0].token_ids) for o in first] == [1]
    while engine.has_unfinished_requests():
        last = engine.step()
    assert last[0].finished and len(last[0].outputs[0].token_ids) == 3
    assert engine.step() == []  # the extra step launched for the finished request was thrown away
    assert engine.block_manager.num_used_pages == 0


def test_data_parallel_replicas_schedule_asynchronously(tiny_dir, engines):
    replicas = LLM(tiny_dir, async_scheduling=True, data_parallel_size=2, **ENGINE)
    requests = workload()
    assert run(replicas, requests) == run(engines[0], requests)


def test_async_scheduling_is_on_by_default_on_accelerators_and_refused_where_it_cannot_be():
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="engine argument async_scheduling: speculative decoding"):
        EngineConfig(async_scheduling=True, speculative_config=ngram)
    with pytest.raises(ValueError, match="engine argument async_scheduling"):
        EngineConfig(async_scheduling="yes")
    assert not use_async_scheduling(EngineConfig(speculative_config=ngram), "gpu")
    assert use_async_scheduling(EngineConfig(), "gpu") and use_async_scheduling(EngineConfig(), "tpu")
    assert not use_async_scheduling(EngineConfig(), "cpu")
    assert use_async_scheduling(EngineConfig(async_scheduling=True), "cpu")
    assert not use_async_scheduling(EngineConfig(async_scheduling=False), "gpu")
    assert not use_async_scheduling(EngineConfig(), "tpu", num_processes=4)  # several hosts step in lockstep
    with pytest.raises(ValueError, match="engine argument async_scheduling: not with several processes"):
        use_async_scheduling(EngineConfig(async_scheduling=True), "tpu", num_processes=4)


def test_an_engine_never_loads_a_sampler_compiled_for_other_step_shapes(tiny_dir, tmp_path):
    # A sampler hands the next step its rows' last tokens padded to the engine's largest sampler: a sampler of one row
    # from an engine of 4 rows at most is another program than one from an engine of 8.
    cache = dict(compilation_cache_dir=str(tmp_path))
    one = {"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = [
        run(LLM(tiny_dir, async_scheduling=True, **ENGINE | cache | dict(max_num_seqs=seqs)), [one]) for seqs in (4, 8)
    ]
    assert outputs[0] == outputs[1] and all(c[2] == "length" for c in outputs[0][0])
