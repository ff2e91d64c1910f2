"""Scheduler properties with a fake model: budgets hold, pages never leak, every request finishes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxpage.engine.block_manager import BlockManager
from jaxpage.engine.kv_cache_groups import KVCacheGroups
from jaxpage.engine.scheduler import Scheduler, SchedulerConfig
from jaxpage.sampling_params import SamplingParams
from jaxpage.sequence import SchedulerOutput, Sequence, SequenceStatus
from jaxpage.worker.pool_sizing import window_group_pages, window_pages_held

PAGE_SIZE = 4


def make_scheduler(num_pages=24, max_num_seqs=4, max_tokens=16, prefix_caching=True):
    block_manager = BlockManager(num_pages, PAGE_SIZE, prefix_caching)
    return Scheduler(SchedulerConfig(max_num_seqs, max_tokens), block_manager)


def update(scheduler: Scheduler, output, token_of=lambda seq: 7) -> list:
    """The scheduler's update after the step `output`, in which each sequence that samples draws token_of(seq)."""
    tokens = np.array([token_of(item.seq) for item in output.scheduled], np.int32).reshape(-1, 1)
    scheduler.launched(output)
    return scheduler.update_from_output(output, tokens)


def run_step(scheduler: Scheduler, next_token: int = 7) -> list:
    """Schedules and updates one step as the engine does, `next_token` sampled where a token is sampled."""
    output = scheduler.schedule()
    update(scheduler, output, lambda seq: next_token)
    return output


def assert_counted(output: SchedulerOutput) -> None:
    """The counts the scheduler gives with a step are those of its items."""
    by_hand = SchedulerOutput(output.scheduled, [])
    counts = (output.num_batched_tokens, output.num_draft_tokens, output.idle_rows, output.num_sampled)
    assert counts == (by_hand.num_batched_tokens, by_hand.num_draft_tokens, by_hand.idle_rows, by_hand.num_sampled)


def unfinished(scheduler: Scheduler) -> bool:
    return bool(scheduler.waiting or scheduler.running)


def make_group(first_id: int, prompt: list[int], n: int) -> list[Sequence]:
    """The n sequences of one request, as the engine makes them."""
    seqs = [Sequence(first_id + i, list(prompt)) for i in range(n)]
    if n > 1:
        for seq in seqs:
            seq.group = tuple(seqs)
    return seqs


def kv_of(seq: Sequence, pos: int) -> tuple[int, ...]:
    """What the K/V of token `pos` depends on: every token up to it."""
    return tuple(seq.token_ids[: pos + 1])


class SchedulerMachine(RuleBasedStateMachine):
    """Requests of 1 to 3 samples, steps, aborts. `pools` play the device: each step applies the copy-on-write copies
    at once, checks that every scheduled sequence finds its computed tokens in the pages its table names (what
    attention reads), then writes the new tokens. Siblings sample different tokens, so a page shared when it should
    have been copied shows. With `window` (HybridSchedulerMachine below): a hybrid model's grouped pool, whose
    window group's table must hold each sequence's last `window` tokens' pages, and no more."""

    window = None

    def __init__(self):
        super().__init__()
        if self.window is None:
            self.scheduler = make_scheduler()
        else:
            window_pages = window_group_pages(24, self.window, PAGE_SIZE, 4, 16)
            groups = KVCacheGroups(24, window_pages, PAGE_SIZE, True, self.window)
            self.scheduler = Scheduler(SchedulerConfig(4, 16), groups)
        self.live: list[tuple[Sequence, int]] = []  # (sequence, max output tokens)
        self.next_id = 0
        managers = getattr(self.scheduler.block_manager, "groups", (self.scheduler.block_manager,))
        self.pools = [[[None] * PAGE_SIZE for _ in range(bm.num_pages)] for bm in managers]

    @rule(
        prompt_len=st.integers(1, 30),
        shared=st.booleans(),
        max_outs=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    )
    def add(self, prompt_len, shared, max_outs):
        # Shared prompts start with the same tokens, so prefix-cache hits happen.
        prompt = [(i % 5) + 1 if shared else (self.next_id * 31 + i) % 97 for i in range(prompt_len)]
        for seq, max_out in zip(make_group(self.next_id, prompt, len(max_outs)), max_outs, strict=True):
            self.scheduler.add(seq)
            self.live.append((seq, max_out))
        self.next_id += len(max_outs)

    @precondition(lambda self: unfinished(self.scheduler))
    @rule()
    def step(self):
        config = self.scheduler.config
        running_before = list(self.scheduler.running)
        output = self.scheduler.schedule()
        assert output.scheduled, "work is waiting but nothing was scheduled"
        assert_counted(output)
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert len(output.scheduled) <= config.max_num_seqs
        self._device_step(output, self.pools[0], "block_table", output.page_copies, None)
        if self.window is not None:
            self._device_step(output, self.pools[1], "window_block_table", output.window_page_copies, self.window)
        for seq in running_before:
            if seq.status is SequenceStatus.WAITING:  # preempted
                assert not seq.block_table and not seq.window_block_table and seq.num_computed_tokens == 0
        update(self.scheduler, output, lambda seq: (seq.seq_id + seq.num_tokens) % 4)  # siblings differ
        for seq, max_out in list(self.live):
            if seq.status is SequenceStatus.RUNNING and len(seq.output_token_ids) >= max_out:
                self.scheduler.finish(seq)
                self.live.remove((seq, max_out))

    @staticmethod
    def _device_step(output, pool, table_name: str, copies, window: int | None):
        """One group's pages through the step: copies, reads of what attention reads (the window's keys only, with
        a window), writes."""
        sources = [list(pool[src]) for src, _ in copies]  # all at once: every source read first
        for (_, dst), data in zip(copies, sources, strict=True):
            pool[dst] = data
        written = set()
        for item in output.scheduled:
            seq, table = item.seq, getattr(item.seq, table_name)
            assert seq.status is SequenceStatus.RUNNING
            assert item.num_new_tokens >= 1
            assert len(table) * PAGE_SIZE >= seq.num_computed_tokens + item.num_new_tokens
            first_read = 0 if window is None else max(0, item.num_computed_tokens - window + 1)
            for pos in range(first_read, item.num_computed_tokens):
                assert pool[table[pos // PAGE_SIZE]][pos % PAGE_SIZE] == kv_of(seq, pos)
            for pos in range(item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens):
                slot = (table[pos // PAGE_SIZE], pos % PAGE_SIZE)
                assert slot not in written, "two sequences write one slot"
                written.add(slot)
        for item in output.scheduled:
            table = getattr(item.seq, table_name)
            for pos in range(item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens):
                pool[table[pos // PAGE_SIZE]][pos % PAGE_SIZE] = kv_of(item.seq, pos)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def abort(self, index):
        # A whole request: every sample of it still live.
        seq, _ = self.live[index % len(self.live)]
        for sibling in seq.group or (seq,):
            if sibling.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(sibling)
        self.live = [(s, m) for s, m in self.live if s.status is not SequenceStatus.FINISHED]

    @invariant()
    def pages_add_up(self):
        manager = self.scheduler.block_manager
        manager.check_invariants()
        for bm in getattr(manager, "groups", (manager,)):
            assert bm.num_used_pages + bm.num_free_pages == bm.num_pages - 1
        assert len(self.scheduler.running) <= self.scheduler.config.max_num_seqs
        for seq in self.scheduler.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.block_table and not seq.window_block_table
        if self.window is None:  # every full page of computed, known tokens is in the prefix cache's chain
            for seq in self.scheduler.running:
                full_pages = min(seq.num_computed_tokens, seq.num_tokens) // PAGE_SIZE
                assert len(manager._seq_hashes[seq.seq_id]) == full_pages, (seq, manager._seq_hashes[seq.seq_id])
        if self.window is not None:  # between steps, a sequence holds the pages of its window's keys, no more
            for seq in self.scheduler.running:
                held = {page for page in seq.window_block_table if page != 0}
                assert len(held) <= window_pages_held(self.window, PAGE_SIZE), (seq.num_computed_tokens, held)

    def teardown(self):
        for seq, _ in self.live:
            self.scheduler.finish(seq)
        assert self.scheduler.block_manager.num_used_pages == 0
        assert not unfinished(self.scheduler)


class HybridSchedulerMachine(SchedulerMachine):
    window = 5  # a hybrid model's (Gemma's) window layers, with pages of their own: jaxpage.engine.kv_cache_groups


TestHybridSchedulerMachine = HybridSchedulerMachine.TestCase
TestHybridSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
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
        if not unfinished(scheduler):
            break
        run_step(scheduler)
        for seq, max_out in seqs:
            if seq.status is SequenceStatus.RUNNING and len(seq.output_token_ids) >= max_out:
                scheduler.finish(seq)
    assert not unfinished(scheduler)
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
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert [item.seq for item in output.scheduled] == [old]
    assert scheduler.waiting[0] is new  # first in line once pages are free again


def run_group(scheduler: Scheduler, seqs: list[Sequence], max_outs: list[int], check=None) -> int:
    """Runs the requests of `seqs` to the end, sample i stopping after max_outs[i] tokens; returns the tokens
    scheduled over all steps. `check(output)` sees each step."""
    for seq in seqs:
        scheduler.add(seq)
    total = 0
    while unfinished(scheduler):
        output = scheduler.schedule()
        assert output.scheduled
        if check is not None:
            check(output)
        update(scheduler, output, lambda seq: (seq.seq_id + seq.num_tokens) % 4)
        total += output.num_batched_tokens
        for seq, max_out in zip(seqs, max_outs, strict=True):
            if seq.status is SequenceStatus.RUNNING and len(seq.output_token_ids) >= max_out:
                scheduler.finish(seq)
        scheduler.block_manager.check_invariants()
    assert scheduler.block_manager.num_used_pages == 0
    return total


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_parallel_samples_compute_the_prompt_once(prefix_caching):
    scheduler = make_scheduler(num_pages=24, max_num_seqs=4, max_tokens=16, prefix_caching=prefix_caching)
    bm = scheduler.block_manager
    parent, *children = seqs = make_group(0, list(range(1, 11)), 4)  # 10 tokens: pages [1-4] [5-8] [9 10]
    for seq in seqs:
        scheduler.add(seq)
    first = scheduler.schedule()
    assert [(i.seq, i.num_new_tokens, i.samples) for i in first.scheduled] == [(parent, 9, False)]
    assert all(seq.status is SequenceStatus.WAITING for seq in children)  # waiting for the prompt
    update(scheduler, first)
    second = scheduler.schedule()  # every sample computes token 9 from its own row
    assert [(i.seq, i.num_computed_tokens, i.num_new_tokens) for i in second.scheduled] == [(s, 9, 1) for s in seqs]
    assert all(item.samples for item in second.scheduled)
    full = parent.block_table[:2]
    assert all(seq.block_table[:2] == full for seq in seqs)
    assert [bm._ref_counts[p] for p in full] == [4, 4]
    tails = [seq.block_table[2] for seq in seqs]  # the partial page: the parent keeps it, each child copies it
    assert len(set(tails)) == 4
    assert second.page_copies == [(tails[0], tail) for tail in tails[1:]]
    bm.check_invariants()
    update(scheduler, second, lambda seq: seq.seq_id)
    third = scheduler.schedule()  # decodes: each writes its own page, nothing is copied
    assert [(i.seq, i.num_new_tokens) for i in third.scheduled] == [(s, 1) for s in seqs] and not third.page_copies
    for seq in seqs:
        scheduler.finish(seq)
    assert bm.num_used_pages == 0
    bm.check_invariants()


def test_a_prompt_ending_on_a_page_boundary_shares_every_page():
    scheduler = make_scheduler()
    seqs = make_group(0, list(range(1, 10)), 3)  # 9 tokens: the 8 shared fill 2 pages
    copies = []
    total = run_group(scheduler, seqs, [2, 2, 2], check=lambda output: copies.extend(output.page_copies))
    assert total == 8 + 3 * 2 and copies == []


@pytest.mark.parametrize(
    ("prompt_len", "budget", "max_num_seqs", "max_outs"),
    [
        (10, 16, 4, [3, 3, 3, 3]),
        (1, 16, 4, [2, 1, 3]),  # a 1-token prompt: nothing to share, every sample computes it
        (40, 8, 4, [2, 5, 1]),  # the parent's prompt takes 5 chunks
        (10, 16, 2, [4, 3, 2, 6, 1]),  # 2 rows: later samples fork a sibling that is still running
        (17, 5, 4, [1, 1, 1, 1]),  # one token each: every sample ends at once
    ],
)
def test_tokens_computed_for_parallel_samples(prompt_len, budget, max_num_seqs, max_outs):
    # Without preemption every token is computed once: the prompt's first L - 1 by one sample, then each sample's
    # last prompt token and outputs but its last: (L - 1) + sum of output lengths.
    for prefix_caching in (True, False):
        scheduler = make_scheduler(
            num_pages=40, max_num_seqs=max_num_seqs, max_tokens=budget, prefix_caching=prefix_caching
        )
        seqs = make_group(0, [(7 * i) % 50 for i in range(prompt_len)], len(max_outs))
        assert run_group(scheduler, seqs, max_outs) == prompt_len - 1 + sum(max_outs)
        assert [len(seq.output_token_ids) for seq in seqs] == max_outs
        assert scheduler.num_preemptions == 0


def test_a_sample_admitted_after_its_siblings_finished_computes_the_prompt_again():
    # One row: the parent runs to the end before its sibling can start; the sibling then has nobody to fork and
    # computes the prompt itself (from the prefix cache where it can), all of it in one step since nobody waits.
    for prefix_caching, recomputed in ((True, 10 - 8), (False, 10)):
        scheduler = make_scheduler(max_num_seqs=1, prefix_caching=prefix_caching)
        seqs = make_group(0, list(range(1, 11)), 2)
        firsts = []  # (tokens, samples) of each step of a sequence without outputs yet

        def check(output, firsts=firsts):
            firsts.extend((i.num_new_tokens, i.samples) for i in output.scheduled if not i.seq.output_token_ids)

        assert run_group(scheduler, seqs, [3, 3], check) == 9 + 3 + recomputed + 2
        assert firsts == [(9, False), (1, True), (recomputed, True)]


def test_preempted_sample_forks_the_prompt_again():
    # 7 pages of 4 tokens; three samples of a 9-token prompt share pages [1-4] [5-8]. As they decode the pool runs
    # out and the newest sample is preempted after 4 tokens. It comes back, once the second one ends, by forking
    # the first's 8 prompt tokens again: it recomputes its last prompt token and 4 outputs, nothing more.
    scheduler = make_scheduler(num_pages=8, max_num_seqs=3, max_tokens=64, prefix_caching=False)
    parent, _, child = seqs = make_group(0, list(range(1, 10)), 3)
    comebacks = []

    def check(output):
        for item in output.scheduled:
            if item.seq is child and item.num_new_tokens > 1:
                comebacks.append((item.num_computed_tokens, item.num_new_tokens))
                assert child.block_table[:2] == parent.block_table[:2]

    total = run_group(scheduler, seqs, [12, 8, 12], check)
    assert scheduler.num_preemptions == 1 and comebacks == [(8, 5)]
    assert total == 8 + (12 + 8 + 12) + 4


def test_abort_before_and_after_the_fork():
    for abort_at in range(4):
        scheduler = make_scheduler(max_tokens=4)
        seqs = make_group(0, list(range(1, 11)), 3)  # the prompt takes 3 steps (chunks of 4, 4, 1), then forks
        for seq in seqs:
            scheduler.add(seq)
        for _ in range(abort_at):
            output = scheduler.schedule()
            update(scheduler, output, lambda seq: seq.seq_id)
        for seq in seqs:
            scheduler.finish(seq)
        assert not unfinished(scheduler) and scheduler.block_manager.num_used_pages == 0
        scheduler.block_manager.check_invariants()


# ----- the update after a step: the one writer of tokens, computed counts and ending by token or length -----


def one_decoding_sequence(params=None, eos=frozenset(), max_model_len=None, prompt_len=6):
    """A scheduler (page size 4) whose one sequence has computed its prompt and decodes next."""
    config = SchedulerConfig(4, 16, max_model_len, eos)
    scheduler = Scheduler(config, BlockManager(24, PAGE_SIZE, True))
    seq = Sequence(0, list(range(1, prompt_len + 1)), sampling_params=params)
    scheduler.add(seq)
    update(scheduler, scheduler.schedule(), lambda s: 100)  # the prompt, then its first token
    return scheduler, seq


@pytest.mark.parametrize(
    ("params", "eos", "max_model_len", "tokens", "expected"),
    [
        (SamplingParams(max_tokens=None), frozenset(), None, [5, 6], (None, None, 3)),
        (SamplingParams(max_tokens=None, stop_token_ids=[5]), frozenset(), None, [5], ("stop", 5, 2)),
        (SamplingParams(max_tokens=None), frozenset({5}), None, [5], ("stop", None, 2)),
        (SamplingParams(max_tokens=None, ignore_eos=True), frozenset({5}), None, [5, 6], (None, None, 3)),
        (SamplingParams(max_tokens=3), frozenset(), None, [5, 6], ("length", None, 3)),
        (SamplingParams(max_tokens=None), frozenset(), 8, [5], ("length", None, 2)),
        # a stop token id that is also EOS, at max_tokens: "stop" with the token, as vLLM says
        (SamplingParams(max_tokens=2, stop_token_ids=[5]), frozenset({5}), None, [5], ("stop", 5, 2)),
        # min_tokens: neither EOS nor a stop token id ends an output shorter than it (the sampler masks them there)
        (SamplingParams(max_tokens=None, min_tokens=3), frozenset({5}), None, [5, 5], ("stop", None, 3)),
        (SamplingParams(max_tokens=None, min_tokens=4, stop_token_ids=[6]), frozenset(), None, [6, 6], (None, None, 3)),
    ],
)
def test_the_update_appends_sampled_tokens_and_ends_by_token_or_length(params, eos, max_model_len, tokens, expected):
    params.validate()
    scheduler, seq = one_decoding_sequence(params, eos, max_model_len)
    for token in tokens:
        (result,) = update(scheduler, scheduler.schedule(), lambda s, token=token: token)
    assert (result.finish_reason, result.stop_reason, len(seq.output_token_ids)) == expected
    assert result.token_ids == [tokens[-1]]
    ended = expected[0] is not None
    assert (seq.status is SequenceStatus.FINISHED) == ended
    assert scheduler.block_manager.num_used_pages == (0 if ended else 2)  # 6 + 2 tokens computed, pages of 4
    scheduler.block_manager.check_invariants()


def test_the_update_keeps_accepted_drafts_gives_back_rejected_slots_and_caches_full_pages():
    scheduler, seq = one_decoding_sequence(SamplingParams(max_tokens=None), prompt_len=6)
    bm = scheduler.block_manager
    assert seq.num_tokens == 7 and seq.num_computed_tokens == 6
    output = scheduler.schedule({seq.seq_id: [8, 9, 10, 11, 12]})  # token 6 and a draft of 5: 6 slots, to 12
    assert_counted(output)
    assert (output.num_draft_tokens, output.num_batched_tokens) == (5, 6)
    assert len(seq.block_table) == 3
    seq.num_draft_computed_tokens = 3
    tokens = np.array([[8, 9, 42, -1, -1, -1]], np.int32)  # 2 drafts accepted, then the target's 42
    scheduler.launched(output)
    (result,) = scheduler.update_from_output(output, tokens, np.array([2]), draft_computed={seq.seq_id: 12})
    assert result.token_ids == [8, 9, 42] and (result.num_draft_tokens, result.num_accepted) == (5, 2)
    assert seq.token_ids[6:] == [100, 8, 9, 42] and seq.num_computed_tokens == 9
    assert seq.num_draft_computed_tokens == 9  # the draft pool's K/V past the accepted tokens is not the sequence's
    assert len(seq.block_table) == 3 and bm.num_used_pages == 3  # slots of the 3 rejected drafts given back
    assert bm.cached_prefix_tokens(seq.token_ids) == 8  # the two full pages, cached once
    bm.check_invariants()


def test_a_stop_token_inside_the_accepted_drafts_ends_the_sequence_there():
    scheduler, seq = one_decoding_sequence(SamplingParams(max_tokens=None, stop_token_ids=[9]))
    output = scheduler.schedule({seq.seq_id: [8, 9, 10]})
    tokens = np.array([[8, 9, 10, 11]], np.int32)  # every draft accepted
    scheduler.launched(output)
    (result,) = scheduler.update_from_output(output, tokens, np.array([3]))
    assert result.token_ids == [8, 9] and (result.finish_reason, result.stop_reason) == ("stop", 9)
    assert seq.output_token_ids == [100, 8, 9] and seq.status is SequenceStatus.FINISHED
    assert scheduler.block_manager.num_used_pages == 0 and not scheduler.running


class StoppingMatcher:
    """An llguidance matcher's surface, for a grammar that is complete after `length` tokens."""

    def __init__(self, length: int):
        self.length, self.consumed = length, []

    def consume_token(self, token: int) -> bool:
        self.consumed.append(token)
        return True

    def is_stopped(self) -> bool:
        return len(self.consumed) >= self.length

    def is_error(self) -> bool:
        return False


def test_a_sequence_ends_when_its_grammar_is_complete_and_its_matcher_follows_every_committed_token():
    from jaxpage.sample.logits_controls import LogitsControls

    matcher = StoppingMatcher(length=3)
    scheduler, seq = one_decoding_sequence(SamplingParams(max_tokens=None))
    seq.controls = LogitsControls(vocab_size=200, matcher=matcher)
    matcher.consumed.append(100)  # the first token, committed before the controls were attached here
    output = scheduler.schedule({seq.seq_id: [8, 9]})
    scheduler.launched(output)
    (result,) = scheduler.update_from_output(output, np.array([[8, 9, 10]], np.int32), np.array([2]))
    assert matcher.consumed == [100, 8, 9]  # the grammar completes at 9: the sampled 10 is not taken
    assert (result.token_ids, result.finish_reason, result.stop_reason) == ([8, 9], "stop", None)
    assert seq.status is SequenceStatus.FINISHED


@settings(max_examples=40, deadline=None)
@given(
    prompt_lens=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    budget=st.integers(8, 400),
    asks=st.lists(st.booleans(), min_size=4, max_size=4),
)
def test_prompt_logprob_rows_cover_each_prompt_position_once_within_the_step_limit(prompt_lens, budget, asks):
    """A request asking for prompt log-probs gets a row for each prompt position 1 .. L - 1, once (no preemption
    here), never more than PROMPT_LOGPROB_TOKENS rows a step; it takes nothing from the prefix cache."""
    from jaxpage.sequence import PROMPT_LOGPROB_TOKENS, prompt_logprob_rows

    scheduler = make_scheduler(num_pages=400, max_num_seqs=4, max_tokens=budget)
    shared = list(range(1, 301))
    seqs = []
    for i, length in enumerate(prompt_lens):
        params = SamplingParams(max_tokens=2, prompt_logprobs=1 if asks[i] else None)
        seqs.append(Sequence(i, shared[:length], sampling_params=params))  # prompts share their prefix
        scheduler.add(seqs[-1])
    seen = {seq.seq_id: [] for seq in seqs}
    while unfinished(scheduler):
        output = scheduler.schedule()
        rows = prompt_logprob_rows(output.scheduled)
        assert len(rows) <= PROMPT_LOGPROB_TOKENS
        for index, _, position in rows:
            seen[output.scheduled[index].seq.seq_id].append(position)
        update(scheduler, output)
    for seq in seqs:
        expected = list(range(1, seq.num_prompt_tokens)) if seq.sampling_params.prompt_logprobs is not None else []
        assert seen[seq.seq_id] == expected  # from position 1: none of its prompt came from the prefix cache
