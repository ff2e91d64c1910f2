"""Continuous batching with chunked prefill and preemption by recompute (host side, no jax).

Every step the scheduler builds one ragged batch under two budgets, `max_num_seqs` sequences and
`max_num_batched_tokens` tokens:

1. Running sequences first, oldest first: a decoding sequence contributes its one new token, a
   sequence in the middle of its prompt the next chunk that fits the token budget. When the pool
   cannot give a running sequence its pages, the most recently admitted running sequence is
   preempted (its pages freed; it is recomputed later) until it can, or the sequence itself waits.
2. Then, if nothing was preempted, waiting sequences in arrival order (preempted ones in front),
   each after a prefix-cache lookup, with as much of their prompt as the token budget allows.

A sequence whose scheduled tokens reach the end of its known tokens gets a token sampled this step.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxpage.block_manager import BlockManager
from jaxpage.sequence import Sequence, SequenceStatus


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512

    def __post_init__(self):
        assert self.max_num_seqs >= 1, self.max_num_seqs
        assert self.max_num_batched_tokens >= 1, self.max_num_batched_tokens


@dataclasses.dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_computed_tokens: int  # tokens already in the cache when the step starts
    num_new_tokens: int  # tokens whose K/V this step computes

    @property
    def samples(self) -> bool:
        """Whether this step ends at the sequence's last known token, so its logits give the next one."""
        return self.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSequence:
        return cls(seq, seq.num_computed_tokens, num_new_tokens)


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    page_copies: list[tuple[int, int]]  # copy-on-write (src, dst) pages to copy before the step
    preempted: list[Sequence]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0  # prompt tokens whose K/V came from the prefix cache

    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Ends a sequence (done or aborted) and returns its pages."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []

        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                scheduled.append(ScheduledSequence.of(seq, num_new))
                budget -= num_new

        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = self.block_manager.match_prefix(seq) if not seq.block_table else 0
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.allocate_slots(seq, num_new):
                self.block_manager.free(seq)  # give back the prefix-cache hits; try again next step
                break
            self.num_prefix_hit_tokens += hits
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence.of(seq, num_new))
            budget -= num_new

        return SchedulerOutput(scheduled, self.block_manager.take_copies(), preempted)

    def _preempt(self, seq: Sequence) -> None:
        """Frees the sequence's pages; it goes back to the front of the queue and recomputes all its tokens."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def commit(self, output: SchedulerOutput) -> None:
        """After the device ran the step: the scheduled tokens are computed, full pages enter the prefix cache."""
        for item in output.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_pages(item.seq)
