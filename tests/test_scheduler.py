"""Scheduler properties with a fake model: budgets hold, pages never leak, every request finishes."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxpage.block_manager import BlockManager
from jaxpage.scheduler import Scheduler, SchedulerConfig
from jaxpage.sequence import Sequence, SequenceStatus

PAGE_SIZE = 4


def make_scheduler(num_pages=24, max_num_seqs=4, max_tokens=16, prefix_caching=True):
    block_manager = BlockManager(num_pages, PAGE_SIZE, prefix_caching)
    return Scheduler(SchedulerConfig(max_num_seqs, max_tokens), block_manager)


def run_step(scheduler: Scheduler, next_token: int = 7) -> list:
    """Schedules and commits one step as the engine does, appending `next_token` where a token is sampled."""
    output = scheduler.schedule()
    scheduler.commit(output)
    for item in output.scheduled:
        if item.samples:
            item.seq.append_token(next_token)
    return output


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.scheduler = make_scheduler()
        self.live: list[tuple[Sequence, int]] = []  # (sequence, max output tokens)
        self.next_id = 0

    @rule(prompt_len=st.integers(1, 30), shared=st.booleans(), max_out=st.integers(1, 12))
    def add(self, prompt_len, shared, max_out):
        # Shared prompts start with the same tokens, so prefix-cache hits happen.
        prompt = [(i % 5) + 1 if shared else (self.next_id * 31 + i) % 97 for i in range(prompt_len)]
        seq = Sequence(self.next_id, prompt)
        self.next_id += 1
        self.scheduler.add(seq)
        self.live.append((seq, max_out))

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule()
    def step(self):
        config = self.scheduler.config
        output = self.scheduler.schedule()
        assert output.scheduled, "work is waiting but nothing was scheduled"
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert len(output.scheduled) <= config.max_num_seqs
        for item in output.scheduled:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING
            assert item.num_new_tokens >= 1
            assert len(seq.block_table) * PAGE_SIZE >= seq.num_computed_tokens + item.num_new_tokens
        for seq in output.preempted:
            assert seq.status is SequenceStatus.WAITING and not seq.block_table
        self.scheduler.commit(output)
        for item in output.scheduled:
            if item.samples:
                item.seq.append_token(3)
        for seq, max_out in list(self.live):
            if seq.status is SequenceStatus.RUNNING and len(seq.output_token_ids) >= max_out:
                self.scheduler.finish(seq)
                self.live.remove((seq, max_out))

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def abort(self, index):
        seq, max_out = self.live.pop(index % len(self.live))
        self.scheduler.finish(seq)

    @invariant()
    def pages_add_up(self):
        bm = self.scheduler.block_manager
        bm.check_invariants()
        assert bm.num_used_pages + bm.num_free_pages == bm.num_pages - 1
        assert len(self.scheduler.running) <= self.scheduler.config.max_num_seqs

    def teardown(self):
        for seq, _ in self.live:
            self.scheduler.finish(seq)
        assert self.scheduler.block_manager.num_used_pages == 0
        assert not self.scheduler.has_unfinished()


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20)), min_size=1, max_size=10),
    num_pages=st.integers(16, 40),
    budget=st.integers(1, 32),
)
def test_every_request_finishes_and_nothing_leaks(lengths, num_pages, budget):
    scheduler = make_scheduler(num_pages=num_pages, max_tokens=budget)
    seqs = []
    for i, (prompt_len, max_out) in enumerate(lengths):
        # Requests that could never fit are refused by the engine; keep only those that fit alone.
        if math.ceil((prompt_len + max_out) / PAGE_SIZE) > num_pages - 1:
            continue
        seq = Sequence(i, [(i + j) % 50 for j in range(prompt_len)])
        scheduler.add(seq)
        seqs.append((seq, max_out))
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        run_step(scheduler)
        for seq, max_out in seqs:
            if seq.status is SequenceStatus.RUNNING and len(seq.output_token_ids) >= max_out:
                scheduler.finish(seq)
    assert not scheduler.has_unfinished()
    assert all(len(seq.output_token_ids) == max_out for seq, max_out in seqs)
    assert scheduler.block_manager.num_used_pages == 0


def test_chunked_prefill_mixes_with_decodes_under_the_token_budget():
    scheduler = make_scheduler(max_tokens=8)
    first = Sequence(0, [1, 2, 3])
    scheduler.add(first)
    run_step(scheduler)  # the 3-token prompt fits in one step and samples
    assert first.num_computed_tokens == 3 and first.output_token_ids == [7]
    second = Sequence(1, list(range(10, 30)))  # 20 tokens: chunks of 7, 8, 5 beside first's decodes
    scheduler.add(second)
    chunks = []
    while len(second.output_token_ids) == 0:
        output = run_step(scheduler)
        assert output.num_batched_tokens <= 8
        assert [item.seq for item in output.scheduled][0] is first  # the running decode goes first
        chunks.append(next(item.num_new_tokens for item in output.scheduled if item.seq is second))
    assert chunks == [7, 7, 6]  # 8-token budget minus first's 1 decode token, then the remainder


def test_preemption_takes_the_newest_request_and_recomputes_it():
    scheduler = make_scheduler(num_pages=7, max_tokens=64, prefix_caching=False)  # 6 usable pages of 4 tokens
    old = Sequence(0, list(range(1, 10)))  # 9 tokens: 3 pages
    new = Sequence(1, list(range(20, 29)))  # 9 tokens: 3 pages
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)
    assert old.status is new.status is SequenceStatus.RUNNING
    for _ in range(3):  # fill both third pages: 12 tokens each, then old needs a 4th page
        run_step(scheduler)
    output = scheduler.schedule()
    assert output.preempted == [new]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert [item.seq for item in output.scheduled] == [old]
    assert scheduler.waiting[0] is new  # first in line once pages are free again
