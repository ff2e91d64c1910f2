"""One sequence's host-side state (its tokens, how many have K/V in the cache, its block table), and what a step
schedules for sequences and does to them: the types the engine, the scheduler and the worker share."""

from __future__ import annotations

import dataclasses
import enum
import functools

import numpy as np

from jaxpage.sample.logits_controls import LogitsControls
from jaxpage.sampling_params import SamplingParams, sampler_settings

# Sequence.sampler_row's columns after the sampler settings (temperature, top_k, top_p, min_p) and the seed: the
# prompt's length (a sampling row's step is its tokens past it), whether it asks for log-probs (1) or not (0), and the
# sampler variant its logits controls need (PROCESSOR_LEVELS: a step takes its rows' highest).
PROMPT_TOKENS_COLUMN, LOGPROBS_COLUMN, PROCESSOR_LEVEL_COLUMN = 5, 6, 7
SAMPLER_ROW_COLUMNS = 8
# The sampler's variants, from the least a row can need: no logits processors; masks (a grammar's bitmask, allowed or
# bad tokens, biases, min_tokens); those and penalties (which take every row's tokens).
NO_PROCESSORS, MASKS, PENALTIES = 0, 1, 2
PROCESSOR_LEVELS = (NO_PROCESSORS, MASKS, PENALTIES)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted: holds no pages
    RUNNING = "running"  # admitted: holds pages for its computed tokens
    FINISHED = "finished"  # done or aborted: its pages are returned


@dataclasses.dataclass(eq=False, slots=True)  # (slots: its fields are read for every sequence of every step)
class Sequence:
    """A prompt and the tokens generated after it.

    `token_ids` is the prompt followed by the output. The first `num_computed_tokens` of them have their
    K/V in the page pool; `block_table[i]` is the page that holds tokens [i * page_size, (i + 1) * page_size).
    `group` holds the n sequences of a request with n > 1 (this one included; empty when n = 1): one of them
    computes the prompt but its last token, the others share its pages (see Scheduler).
    With a draft model (speculative decoding), its own pool has the same pages: `num_draft_computed_tokens`, at
    most num_computed_tokens, of the tokens have their K/V there too. The draft model catches up only when the
    sequence drafts (DraftModelRunner.catch_up), so that steps that do not draft do not run it. Only the scheduler
    writes a Sequence (its block manager the block table): Scheduler.launched when a step is on its way to the
    device, Scheduler.update_from_output when its tokens are back.

    With asynchronous scheduling the scheduler plans the next step before the tokens of the step on the device are
    known: `num_pending_tokens` counts the tokens a launched step samples for this sequence that are not in
    token_ids yet. The step after reads such a token from the device (jaxpage.worker.step_inputs); the host appends
    it when its step's results come back.
    """

    seq_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    num_draft_computed_tokens: int = 0
    block_table: list[int] = dataclasses.field(default_factory=list)
    # A hybrid model's window group of layers, whose pages are its own (jaxpage.engine.kv_cache_groups): its table,
    # the null page before the window.
    window_block_table: list[int] = dataclasses.field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    sampling_params: SamplingParams | None = None  # None: greedy
    seed: int = 0  # the request's seed (drawn by the engine when the request gives none)
    # What changes its logits before sampling (a grammar's matcher, biases, penalties...); None: nothing.
    controls: LogitsControls | None = None
    group: tuple[Sequence, ...] = dataclasses.field(default=(), repr=False)
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache had when first admitted (None: not yet)
    num_pending_tokens: int = 0  # sampled by launched steps, not yet known here (asynchronous scheduling)
    # Its LoRA adapter (jaxpage.engine.lora_slots): the request's lora_int_id (0: none), the adapter's weights
    # (jaxpage.models.lora_adapter.LoRAAdapter), the device slot it is in while the sequence runs (-1: none), and the
    # adapter's digest, which roots the prefix-cache keys of its pages (two adapters' K/V of the same tokens differ:
    # they never share a page).
    lora_id: int = 0
    lora_adapter: object = dataclasses.field(default=None, repr=False)
    lora_slot: int = -1
    prefix_root: bytes | None = None
    # Set by the scheduler when it queues the sequence (Scheduler.add), for its steps' quick checks: the token count
    # at which its length ends it (max_tokens, max_model_len), and the tokens that end it as soon as they come (EOS
    # unless ignore_eos, its stop token ids), or None where no token can be judged alone (min_tokens, a grammar).
    max_num_tokens: int = dataclasses.field(default=2**62, repr=False)
    ending_tokens: frozenset[int] | None = dataclasses.field(default=None, repr=False)
    _sampler_row: tuple | None = dataclasses.field(default=None, init=False, repr=False)  # (sampler_row's, once)

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def sampler_row(self) -> tuple[float, int, float, float, int, int, int, int]:
        """(its sampler settings: jaxpage.sampling_params.sampler_settings, its seed mod 2**32, then the columns
        PROMPT_TOKENS_COLUMN to PROCESSOR_LEVEL_COLUMN say), as every step that samples it takes them (worked out
        once, when the block manager first sees it: none of them changes once it is queued)."""
        if self._sampler_row is None:
            params, controls = self.sampling_params, self.controls
            logprobs = int(params is not None and params.logprobs is not None)
            level = NO_PROCESSORS if controls is None else PENALTIES if controls.uses_penalties else MASKS
            settings = sampler_settings(params)
            self._sampler_row = (*settings, self.seed % 2**32, len(self.prompt_token_ids), logprobs, level)
        return self._sampler_row

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_known_output_tokens(self) -> int:
        """Tokens sampled after the prompt and appended (the pending ones not included)."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model: the rest of the prompt, or the last sampled token (known or
        pending)."""
        return self.num_tokens + self.num_pending_tokens - self.num_computed_tokens

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled after the prompt, the pending ones included."""
        return self.num_tokens + self.num_pending_tokens - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        """Commits a token (the scheduler does, in update_from_output); a grammar's matcher follows it."""
        self.token_ids.append(token_id)
        if self.controls is not None:
            self.controls.accept(token_id)


@dataclasses.dataclass(slots=True)  # not frozen: a frozen dataclass costs four times as much to make, once a row a step
class ScheduledSequence:
    seq: Sequence
    num_computed_tokens: int  # tokens already in the cache when the step starts
    num_new_tokens: int  # tokens whose K/V this step computes, draft tokens included
    draft_token_ids: tuple[int, ...] = ()  # speculative tokens after the sequence's last one, verified this step
    # Whether this step reaches the sequence's last token (known or pending), so its logits give the next one.
    samples: bool = False

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int, draft_token_ids: tuple[int, ...] = ()) -> ScheduledSequence:
        computed = seq.num_computed_tokens
        reached = computed + num_new_tokens - len(draft_token_ids)
        samples = reached == len(seq.token_ids) + seq.num_pending_tokens
        return cls(seq, computed, num_new_tokens, draft_token_ids, samples)


# Prompt tokens a step can give log-probs of (SamplingParams.prompt_logprobs): the forward pass hands the sampler
# side this many hidden rows every step (a fixed shape), and the scheduler keeps such prompts' chunks within it.
PROMPT_LOGPROB_TOKENS = 128


def prompt_logprob_rows(items: list[ScheduledSequence]) -> list[tuple[int, int, int]]:
    """The step's rows of prompt log-probs, in order: (item index, the token's index in the step, the prompt
    position it predicts). A prompt token's log-prob is read off the hidden state of the token before it, so an
    item computing prompt tokens [c, c + n) gives those of positions c + 1 .. min(c + n, L - 1) (L: prompt length;
    position 0 has none). Only items whose request asks for prompt_logprobs."""
    rows = []
    start = 0
    for index, item in enumerate(items):
        params = item.seq.sampling_params
        if params is not None and params.prompt_logprobs is not None:
            first, last = (
                item.num_computed_tokens,
                min(item.num_computed_tokens + item.num_new_tokens, item.seq.num_prompt_tokens - 1),
            )
            rows += [(index, start + p - first, p + 1) for p in range(first, last)]
        start += item.num_new_tokens
    return rows


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    page_copies: list[tuple[int, int]]  # copy-on-write (src, dst) pages to copy, all at once, before the step
    window_page_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # the window group's
    # (slot, adapter) of the LoRA adapters to copy into their device slots before the step (LoRASlots.acquire)
    lora_loads: list[tuple[int, object]] = dataclasses.field(default_factory=list)
    # The host tier's page copies (jaxpage.engine.host_page_cache.PageTransfer), a list per group of the pool's layers,
    # to apply in order before the step's copy-on-write copies: evicted pages into host slots, host slots into pages.
    page_transfers: tuple[list, ...] = ()
    # The scheduled sequences' block tables, a row each in order (and the window group's, in a grouped pool), as the
    # block manager holds them (jaxpage.engine.block_tables), null pages past their ends; None: read from the
    # sequences' lists.
    block_tables: object = None
    window_block_tables: object = None
    # Their sampler rows (Sequence.sampler_row), [items, SAMPLER_ROW_COLUMNS] float64, as the block manager holds them;
    # None: read from the sequences (max_sampled).
    sampler_rows: object = None
    num_admitted: int = 0  # the last items of `scheduled` are the sequences admitted from the waiting queue this step
    # False where the scheduler knows that no item computes prompt log-probs this step (so none are looked for).
    prompt_logprobs_asked: bool = True
    # Counted by the scheduler as it builds the step (worked out from `scheduled` where not given: an output made by
    # hand), so that nothing after it goes over every item again for them: the tokens the step computes (draft
    # tokens included), its draft tokens, and the items that do not sample (a prompt's chunk short of its end).
    num_batched_tokens: int | None = None
    num_draft_tokens: int | None = None
    idle_rows: tuple[int, ...] | None = None

    def __post_init__(self):
        scheduled, counted = self.scheduled, object.__setattr__
        if self.num_batched_tokens is None:
            counted(self, "num_batched_tokens", sum(item.num_new_tokens for item in scheduled))
        if self.num_draft_tokens is None:
            counted(self, "num_draft_tokens", sum(len(item.draft_token_ids) for item in scheduled))
        if self.idle_rows is None:
            counted(self, "idle_rows", tuple(row for row, item in enumerate(scheduled) if not item.samples))

    @property
    def num_sampled(self) -> int:
        """Items that sample (the step's rows of the LM head)."""
        return len(self.scheduled) - len(self.idle_rows)

    def max_sampled(self, column: int) -> int:
        """The highest value of a column of the sampler rows (Sequence.sampler_row) of the items that sample (0 where
        none does): from sampler_rows, else from the sequences."""
        if self.sampler_rows is None:
            return max([item.seq.sampler_row[column] for item in self.scheduled if item.samples], default=0)
        values = self.sampler_rows[:, column]
        values = np.delete(values, self.idle_rows) if self.idle_rows else values
        return int(values.max()) if len(values) else 0

    @functools.cached_property
    def prompt_logprob_rows(self) -> list[tuple[int, int, int]]:
        """prompt_logprob_rows(self.scheduled), worked out once."""
        return prompt_logprob_rows(self.scheduled) if self.prompt_logprobs_asked else []


@dataclasses.dataclass(slots=True)  # not frozen, as ScheduledSequence
class SequenceUpdate:
    """What one step did to a sequence that sampled (Scheduler.update_from_output)."""

    seq: Sequence
    row: int  # its item's index in the step
    token_ids: list[int]  # appended this step: accepted draft tokens, then the sampled one (cut at an ending one)
    num_draft_tokens: int  # draft tokens verified (0 without speculative decoding)
    num_accepted: int  # ... and accepted
    finish_reason: str | None  # "stop" (a stop token id or EOS), "length", or None: it goes on
    stop_reason: int | None  # the stop token id that ended it
