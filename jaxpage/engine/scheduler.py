"""Continuous batching with chunked prefill and preemption by recompute (host side, no jax).

Every step the scheduler builds one ragged batch under two budgets, `max_num_seqs` sequences and
`max_num_batched_tokens` tokens:

1. Running sequences first, oldest first: a decoding sequence contributes its one new token, a
   sequence in the middle of its prompt the next chunk that fits the token budget. When the pool
   cannot give a running sequence its pages, the most recently admitted running sequence is
   preempted (its pages freed; it is recomputed later) until it can, or the sequence itself waits.
2. Then, if nothing was preempted, waiting sequences in arrival order (preempted ones in front),
   each after a prefix-cache lookup, with as much of their prompt as the token budget allows.

A sequence whose scheduled tokens reach the end of its tokens gets a token sampled this step.

A step's bookkeeping comes in two halves: `launched` when the step is on its way to the device (its tokens are
computed: the counts advance, each sampled token is pending), `update_from_output` when its tokens are back (they are
appended, the sequences that end are finished). Run back to back they make a synchronous step. With asynchronous
scheduling the engine schedules and launches the next step between the two: a sequence decodes its pending token
(the device feeds it in), and one whose pending token ends it by its length is not scheduled; one that a pending
token ends otherwise (EOS, a stop token or string) computes one more token, which update_from_output throws away
with the rest of a finished sequence's results.

Speculative decoding: `schedule(drafts)` takes draft tokens proposed for decoding sequences. A sequence with a draft
of d tokens computes 1 + d tokens (its last token, then the draft), whose slots are reserved like any others; the
step verifies the draft (jaxpage.sample.rejection_sampler) and `update_from_output` gives back the slots of the
rejected tokens. Drafts are used only in steps without prefill: when every running sequence is decoding and no
waiting sequence can be admitted (none waits, every row is taken, or the first in the queue lacks the free pages for
its first chunk); a step with drafts admits no one. A step thus either verifies or prefills. A draft is cut to the
token budget; when its slots cannot be had, the sequence goes on without it before anyone is preempted.

Parallel sampling (a request with n > 1, its sequences in `Sequence.group`): the prompt of L tokens is computed
once. The first sequence of the group to be admitted computes its first L - 1 tokens (its prefill stops there while
a sibling waits); a waiting sibling is admitted by forking a running sibling that has them: it shares the pages
that hold them and computes token L - 1 itself, so every sample draws its first token from its own row (n tokens,
not n * L). A partly filled last shared page is copied by each sequence that writes into it while it is shared
(copy-on-write, in the block manager). A waiting sibling skips its turn while another one is still computing the
prompt; one that finds no running sibling (all preempted or finished) computes the prompt itself. A preempted
sibling comes back the same way, forking the prompt again when a sibling runs.
"""

from __future__ import annotations

import collections

import numpy as np

from jaxpage.config import SchedulerConfig
from jaxpage.engine.block_manager import BlockManager
from jaxpage.engine.kv_cache_groups import KVCacheGroups
from jaxpage.engine.lora_slots import LoRASlots
from jaxpage.sequence import (  # noqa: F401 (the step's types, re-exported)
    PROMPT_LOGPROB_TOKENS,
    ScheduledSequence,
    SchedulerOutput,
    Sequence,
    SequenceStatus,
    SequenceUpdate,
)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager | KVCacheGroups, lora_slots: LoRASlots | None = None
    ):
        self.config = config
        self.block_manager = block_manager
        # The LoRA adapters' device slots (shared by the data-parallel replicas, whose weights are one copy): a running
        # sequence pins its adapter's; one whose adapter finds every slot pinned by others waits, the rest go on.
        self.lora_slots = lora_slots
        self._lora_loads: list[tuple[int, object]] = []  # (slot, adapter) to fill before the step being scheduled
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0  # prompt tokens whose K/V came from the prefix cache
        self.num_prefix_query_tokens = 0  # tokens of the sequences admitted after a prefix-cache lookup
        self._prompt_logprob_rows = PROMPT_LOGPROB_TOKENS  # left in the step being scheduled

    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
        params, max_model_len = seq.sampling_params, self.config.max_model_len
        seq.max_num_tokens = max_model_len if max_model_len is not None else seq.max_num_tokens
        if params is not None and params.max_tokens is not None:
            seq.max_num_tokens = min(seq.max_num_tokens, seq.num_prompt_tokens + params.max_tokens)
        if seq.controls is None and (params is None or not params.min_tokens):
            eos = frozenset() if params is not None and params.ignore_eos else self.config.eos_token_ids
            seq.ending_tokens = frozenset(eos) | frozenset(params.stop_token_ids if params is not None else ())
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Ends a sequence (done or aborted) and returns its pages; the tokens of its launched steps will be
        thrown away."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._unpin_lora(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.num_pending_tokens = 0

    def can_draft(self) -> bool:
        """Whether this step can verify drafts: every running sequence decodes and no waiting one can be admitted
        (see the module docstring). The engine proposes drafts only then."""
        if not all(seq.num_uncomputed_tokens == 1 for seq in self.running):
            return False
        if not self.waiting or len(self.running) == self.config.max_num_seqs:
            return True
        head = self.waiting[0]
        if head.lora_id and not self.lora_slots.can_acquire(head.lora_id):
            return True  # it waits for a LoRA slot
        first_chunk = min(head.num_uncomputed_tokens, self.config.max_num_batched_tokens)
        return not self.block_manager.can_allocate(head, first_chunk)

    def schedule(self, drafts: dict[int, list[int]] | None = None) -> SchedulerOutput:
        """The next step. `drafts`: draft tokens by seq_id, for decoding sequences, when `can_draft()`."""
        budget = self.config.max_num_batched_tokens
        self._prompt_logprob_rows = PROMPT_LOGPROB_TOKENS  # prompt tokens this step may give log-probs of
        scheduled: list[ScheduledSequence] = []
        idle: list[int] = []  # the items that do not sample
        preempted = False
        drafts = drafts or {}
        self._lora_loads = []
        assert not drafts or self.can_draft(), "drafts are for steps without prefill"

        allocate = self.block_manager.allocate_slots
        running_status = SequenceStatus.RUNNING
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not running_status:
                continue  # preempted earlier in this loop
            pending = seq.num_pending_tokens
            num_tokens = len(seq.token_ids) + pending
            if pending and num_tokens >= seq.max_num_tokens:
                continue  # a pending token ends it by its length
            computed = seq.num_computed_tokens
            num_new = num_tokens - computed  # (to its end: it samples)
            if not drafts and 0 < num_new <= budget and computed >= len(seq.prompt_token_ids) - 1:  # decoding
                if allocate(seq, num_new):
                    scheduled.append(ScheduledSequence(seq, computed, num_new, (), True))
                    budget -= num_new
                    continue
            num_new = self._num_new_tokens(seq, budget)
            if num_new == 0:  # its prompt's log-probs wait for the next step
                continue
            if drafts:
                draft = tuple(drafts.get(seq.seq_id, ()))[: budget - num_new]
                if draft and allocate(seq, num_new + len(draft)):
                    scheduled.append(ScheduledSequence.of(seq, num_new + len(draft), draft))
                    budget -= num_new + len(draft)
                    continue
            while not allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                item = ScheduledSequence.of(seq, num_new)
                if not item.samples:
                    idle.append(len(scheduled))
                scheduled.append(item)
                budget -= num_new

        num_tokens = self.config.max_num_batched_tokens - budget
        num_drafts = sum(len(item.draft_token_ids) for item in scheduled) if drafts else 0
        admitted = self._admit(budget) if not preempted and not drafts else []
        idle += [row for row, item in enumerate(admitted, len(scheduled)) if not item.samples]
        num_tokens += sum(item.num_new_tokens for item in admitted)
        scheduled += admitted
        manager = self.block_manager
        copies = (manager.take_copies(), manager.take_window_copies())
        tables = manager.block_tables([item.seq for item in scheduled]) if scheduled else (None, None, None)
        asked = self._prompt_logprob_rows < PROMPT_LOGPROB_TOKENS  # (an item that computes some took rows for them)
        transfers = manager.take_transfers()
        counts = (num_tokens, num_drafts, tuple(idle))
        return SchedulerOutput(scheduled, *copies, self._lora_loads, transfers, *tables, len(admitted), asked, *counts)

    def _admit(self, budget: int) -> list[ScheduledSequence]:
        """Admits waiting sequences in order while budget, rows and pages last (see the module docstring)."""
        scheduled: list[ScheduledSequence] = []
        admitted: list[Sequence] = []
        for seq in self.waiting:
            if budget == 0 or len(self.running) == self.config.max_num_seqs:
                break
            if seq.lora_id and not self.lora_slots.can_acquire(seq.lora_id):
                continue  # every LoRA slot is pinned by other adapters' sequences
            shared = seq.num_prompt_tokens - 1  # the prompt tokens siblings share
            sibling = max(
                (s for s in seq.group if s.status is SequenceStatus.RUNNING),
                key=lambda s: s.num_computed_tokens,
                default=None,
            )
            if sibling is None and seq.sampling_params is not None and seq.sampling_params.prompt_logprobs is not None:
                hits = queried = 0  # every prompt token's log-prob is computed: nothing comes from the prefix cache
            elif sibling is not None and sibling.num_computed_tokens < shared:
                continue  # the sibling is computing the prompt: fork from it once it has
            elif sibling is not None and self.block_manager.can_fork(sibling, shared):
                self.block_manager.fork(sibling, seq, shared)
                hits = queried = 0
            else:  # no sibling, or one that gave back prompt pages this one reads (sliding window): the prefix cache
                hits = self.block_manager.match_prefix(seq)
                queried = seq.num_tokens if self.block_manager.enable_prefix_caching else 0
            num_new = self._num_new_tokens(seq, budget)
            if num_new == 0:
                continue
            if not self.block_manager.allocate_slots(seq, num_new):
                self.block_manager.free(seq)  # give back the shared pages; try again next step
                break
            self.num_prefix_hit_tokens += hits
            self.num_prefix_query_tokens += queried
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = hits
            admitted.append(seq)
            self._pin_lora(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence.of(seq, num_new))
            budget -= num_new
        for seq in admitted:
            self.waiting.remove(seq)
        return scheduled

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        """Tokens of seq to compute this step: what the budget allows, but a prompt stops before its last token
        while a sibling waits to fork it, and a prompt whose log-probs are asked for computes no more of them than
        the step has rows of prompt log-probs left (PROMPT_LOGPROB_TOKENS a step; it takes them)."""
        num_new = min(seq.num_uncomputed_tokens, budget)
        shared = seq.num_prompt_tokens - 1
        if seq.num_computed_tokens >= shared:  # (decoding: most calls)
            return num_new
        if seq.group and any(s.status is SequenceStatus.WAITING and s is not seq for s in seq.group):
            num_new = min(num_new, shared - seq.num_computed_tokens)
        params = seq.sampling_params
        if params is not None and params.prompt_logprobs is not None:
            num_new = min(num_new, self._prompt_logprob_rows)
            self._prompt_logprob_rows -= min(seq.num_computed_tokens + num_new, shared) - seq.num_computed_tokens
        return num_new

    def _preempt(self, seq: Sequence) -> None:
        """Frees the sequence's pages; it goes back to the front of the queue and recomputes all its tokens."""
        self.running.remove(seq)
        self._unpin_lora(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _pin_lora(self, seq: Sequence) -> None:
        """A slot for the admitted sequence's adapter, filled before this step where it is new there."""
        if seq.lora_id:
            seq.lora_slot, load = self.lora_slots.acquire(seq.lora_id)
            if load:
                self._lora_loads.append((seq.lora_slot, seq.lora_adapter))

    def _unpin_lora(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.lora_slots.release(seq.lora_id)
            seq.lora_slot = -1

    def launched(self, output: SchedulerOutput) -> None:
        """The step `output` is on its way to the device: its scheduled tokens count as computed (draft tokens
        included, until update_from_output gives back the rejected ones), and each sampled token is pending."""
        for item in output.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            item.seq.num_pending_tokens += item.samples

    def update_from_output(
        self,
        output: SchedulerOutput,
        token_ids: np.ndarray,
        num_accepted: np.ndarray | None = None,
        draft_computed: dict[int, int] | None = None,
    ) -> list[SequenceUpdate]:
        """After the device ran the step `output` (`launched` before): the one writer of what its results change in
        its sequences. Items of sequences that finished since it was launched (an abort, or a token of the step
        before) are passed over: what they computed is thrown away.

        The scheduled tokens stay computed, but for the draft tokens that verification rejected (`num_accepted`:
        accepted draft tokens per item; None: none drafted), whose slots go back. Each item that samples gets its
        accepted drafts and then its sampled token (`token_ids[i]`: [k + 1] per item), up to the first that ends it:
        a stop token id, EOS (unless ignore_eos), max_tokens or max_model_len; an ended sequence's pages are freed.
        Full pages of known, computed tokens enter the prefix cache. `draft_computed`: by seq_id, the tokens whose
        K/V a draft model's pool holds after this step (jaxpage.spec_decode), kept at most the computed tokens.
        Returns an update per item that sampled, in order."""
        updates = []
        drafting = token_ids.shape[1] > 1  # a verify step (else each row's one token, no drafts)
        rows = token_ids.tolist() if drafting else token_ids[:, 0].tolist()  # one conversion, not one a row
        accepted_rows = num_accepted.tolist() if drafting and num_accepted is not None else None
        manager = self.block_manager
        windowed, page_size = manager.sliding_window is not None, manager.page_size
        running_status, finished_status = SequenceStatus.RUNNING, SequenceStatus.FINISHED
        for i, item in enumerate(output.scheduled):
            seq = item.seq
            status = seq.status
            if status is finished_status:
                continue
            running = status is running_status  # not preempted since it was launched
            accepted = accepted_rows[i] if accepted_rows is not None else 0
            drafted = len(item.draft_token_ids)
            if drafted or draft_computed is not None:
                self._settle_drafts(item, accepted, running, draft_computed)
            if not item.samples:
                if running:
                    manager.cache_full_pages(seq)
                    if windowed:
                        manager.free_outside_window(seq)
                continue
            seq.num_pending_tokens -= 1
            if drafting:
                new_tokens = rows[i][: accepted + 1]
                for position, token in enumerate(new_tokens):
                    seq.append_token(token)
                    finish_reason, stop_reason = _finished_by(seq, token, self.config.eos_token_ids)
                    if finish_reason is not None:
                        del new_tokens[position + 1 :]
                        break
            else:  # (most steps: one token, which most often ends nothing)
                token = rows[i]
                new_tokens = [token]
                token_ids = seq.token_ids
                token_ids.append(token)  # (seq.append_token's, inline)
                if seq.controls is not None:
                    seq.controls.accept(token)
                ending = seq.ending_tokens
                if ending is None or token in ending or len(token_ids) >= seq.max_num_tokens:
                    finish_reason, stop_reason = _finished_by(seq, token, self.config.eos_token_ids)
                else:
                    finish_reason = stop_reason = None
            # A page fills where the tokens both computed and known reach its end: after a step of one new token,
            # only where they reach a multiple of the page size (else cache_full_pages has nothing to register).
            if running and (
                drafting
                or item.num_new_tokens != 1
                or min(seq.num_computed_tokens, len(seq.token_ids)) % page_size == 0
            ):
                manager.cache_full_pages(seq)
            if running and windowed:
                manager.free_outside_window(seq)
            if finish_reason is not None:
                self.finish(seq)
            updates.append(SequenceUpdate(seq, i, new_tokens, drafted, accepted, finish_reason, stop_reason))
        return updates

    def _settle_drafts(
        self, item: ScheduledSequence, accepted: int, running: bool, draft_computed: dict[int, int] | None
    ) -> None:
        """After a verify step: the slots of item's rejected draft tokens go back, and a draft model's computed
        tokens follow (update_from_output)."""
        seq, drafted = item.seq, len(item.draft_token_ids)
        rejected = drafted - accepted
        assert 0 <= rejected <= drafted, (rejected, item)
        if running:
            seq.num_computed_tokens -= rejected
        if draft_computed is not None and seq.seq_id in draft_computed:
            seq.num_draft_computed_tokens = draft_computed[seq.seq_id]
        # A draft model's K/V of rejected drafts is not the sequence's.
        seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, seq.num_computed_tokens)
        if rejected and running:
            self.block_manager.release_slots(seq, seq.num_computed_tokens)


def _finished_by(seq: Sequence, token: int, eos_token_ids: frozenset[int]) -> tuple[str | None, int | None]:
    """(finish_reason, stop_reason) of a sequence whose last token is `token`: ("stop", token) for a stop token
    id, ("stop", None) for EOS (neither while the output is shorter than min_tokens) or a complete grammar,
    ("length", None) at max_tokens or max_model_len, else (None, None). Stop strings are the output processor's
    (jaxpage.engine.output_processor). update_from_output asks only where the token may end it (Sequence.ending_tokens,
    max_num_tokens)."""
    params = seq.sampling_params
    # stop ids cannot end it before min_tokens
    early = params is not None and params.min_tokens and seq.num_known_output_tokens < params.min_tokens
    if params is not None and token in params.stop_token_ids and not early:
        return "stop", token
    if (params is None or not params.ignore_eos) and token in eos_token_ids and not early:
        return "stop", None
    if seq.controls is not None and seq.controls.grammar_ended:
        return "stop", None
    if len(seq.token_ids) >= seq.max_num_tokens:
        return "length", None
    return None, None
