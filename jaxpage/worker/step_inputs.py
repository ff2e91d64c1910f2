"""A step's host arrays: what the forward pass and the sampler take, padded to one of the step shapes
(jaxpage.worker.step_shapes), one replica's (`prepare`), or every data-parallel replica's stacked on a leading axis
(`stacked`), as the programs over several devices take them."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.attention import PagedBatch
from jaxpage.sample.logits_controls import bitmask_words
from jaxpage.sample.logits_processors import LogitsInputs, PenaltyInputs
from jaxpage.sample.sampler import SamplingMetadata, sampling_metadata_from_table
from jaxpage.sampling_params import GREEDY_SETTINGS, SamplingParams
from jaxpage.sequence import (  # noqa: F401 (PROCESSOR_LEVELS, re-exported)
    LOGPROBS_COLUMN,
    MASKS,
    NO_PROCESSORS,
    PENALTIES,
    PROCESSOR_LEVEL_COLUMN,
    PROCESSOR_LEVELS,
    PROMPT_LOGPROB_TOKENS,
    PROMPT_TOKENS_COLUMN,
    SAMPLER_ROW_COLUMNS,
    ScheduledSequence,
    SchedulerOutput,
)
from jaxpage.structured.bitmask import fill_grammar_bitmasks
from jaxpage.worker.host_kv_pool import TRANSFER_CHUNK
from jaxpage.worker.kv_pool import COPY_CHUNK
from jaxpage.worker.step_broadcast import Header, Message, unpack
from jaxpage.worker.step_shapes import StepShape


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    token_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    attention: PagedBatch
    logits_indices: jax.Array  # [R * (k + 1)] int32, the tokens whose logits each sampler row uses (k: see SampleInput)
    prompt_indices: jax.Array  # [PROMPT_LOGPROB_TOKENS] int32, the tokens whose hidden states give prompt log-probs
    # Asynchronous scheduling: a token the host does not know yet, sampled by the step before, is read on the device:
    # feed_index[t] >= 0 takes token t from row feed_index[t] of that step's sampled tokens, `fed_tokens`
    # [max sample rows] (each row's last token; ModelRunner puts the previous step's in); -1 keeps token_ids[t].
    feed_index: jax.Array  # [T] int32
    fed_tokens: jax.Array  # [max sample rows] int32
    lora_slots: jax.Array | None = None  # [T] int32: each token's LoRA slot, -1 for none (None: LoRA is off)

    def with_fed_tokens(self) -> jax.Array:
        """token_ids with the fed ones in (on the device, inside the forward pass)."""
        fed = self.fed_tokens[jnp.maximum(self.feed_index, 0)]
        return jnp.where(self.feed_index >= 0, fed, self.token_ids)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleInput:
    sampling: SamplingMetadata  # [R] rows
    want_logprobs: jax.Array  # [] bool: some row asks for logprobs (else they are not computed)
    draft_tokens: jax.Array  # [R, k] int32: each row's draft tokens (k = 0: a plain step, one token per row)
    num_drafts: jax.Array  # [R] int32 in [0, k]: how many of its k are real
    draft_probs: jax.Array | None = None  # [R, k, V] float32 the draft model's distributions; None: point masses
    logits: LogitsInputs | None = None  # [R * (k + 1)] rows of logits processors; None: no row uses any


def step_flag(level: int, with_draft_probs: bool, feeds: bool = False) -> int:
    """A STEP message's flag: the sampler's level of logits processors, whether the step reads tokens of the step
    before on the device (StepInput.feed_index), and whether its sampler takes a draft model's distributions."""
    return 4 * level + 2 * int(feeds) + int(with_draft_probs)


def split_step_flag(flag: int) -> tuple[int, bool, bool]:
    """(level, feeds, with_draft_probs) of a step_flag."""
    level, rest = divmod(flag, 4)
    return level, bool(rest & 2), bool(rest & 1)


def row_sampling(
    items: list,
    num_rows: int,
    sampler_rows: np.ndarray | None = None,
    idle_rows: tuple[int, ...] | None = None,
    known_tokens: np.ndarray | None = None,
) -> SamplingMetadata:
    """The sampling settings of the scheduled items, a row each (greedy for an item that does not sample this step),
    padded to num_rows. sampler_rows: the items' Sequence.sampler_row as the block manager holds them, idle_rows: the
    items that do not sample, known_tokens: each item's tokens known or pending (for one that samples: its computed
    and new tokens less its drafts); each None: read from the items."""
    count = len(items)
    if count > num_rows:
        raise ValueError(f"{count} rows do not fit in num_rows={num_rows}")
    table = np.zeros((num_rows, SAMPLER_ROW_COLUMNS), np.float64)  # each row's settings, seed (exact: below 2**32)...
    table[:, :4] = GREEDY_SETTINGS
    steps = np.zeros(num_rows, np.int32)
    if count:
        table[:count] = [item.seq.sampler_row for item in items] if sampler_rows is None else sampler_rows
        idle = [row for row, item in enumerate(items) if not item.samples] if idle_rows is None else idle_rows
        if known_tokens is None:
            steps[:count] = [_output_tokens(item.seq) for item in items]
        else:  # (an item that does not sample is greedy: its step is read from its sequence as it ever was)
            steps[:count] = known_tokens - table[:count, PROMPT_TOKENS_COLUMN]
            steps[list(idle)] = [_output_tokens(items[row].seq) for row in idle]
        if idle:
            table[list(idle), :4] = GREEDY_SETTINGS
    return sampling_metadata_from_table(table, steps)


def _output_tokens(seq) -> int:
    """A sequence's tokens past its prompt, pending ones included (a sampling row's step)."""
    return len(seq.token_ids) + seq.num_pending_tokens - len(seq.prompt_token_ids)


def token_lora_slots(items: list[ScheduledSequence], num_tokens: int) -> np.ndarray:
    """[num_tokens] int32: each of the step's tokens' LoRA slot (its sequence's lora_slot), -1 for padding."""
    slots = np.full(num_tokens, -1, np.int32)
    counts = [item.num_new_tokens for item in items]
    slots[: sum(counts)] = np.repeat(np.asarray([item.seq.lora_slot for item in items], np.int32), counts)
    return slots


def table_rows(tables: list[list[int]]) -> np.ndarray:
    """[len(tables), longest] int32: block tables as rows, null pages past their ends."""
    rows = np.zeros((len(tables), max(map(len, tables), default=0)), np.int32)
    for row, table in enumerate(tables):
        rows[row, : len(table)] = table
    return rows


class StepInputs:
    def __init__(
        self,
        shapes: list[StepShape],
        page_size: int,
        max_model_len: int,
        data_parallel_size: int,
        stack: bool,
        draft_vocab_size: int = 0,
        vocab_size: int = 0,
        window_group: bool = False,
        lora_slot: dict | None = None,
    ):
        """stack: the programs take arrays stacked over the replicas (they run on a mesh); draft_vocab_size: verify
        steps take a draft model's distributions over that vocabulary (0: point masses); vocab_size: the model's
        (the width of the logits processors' bitmasks); window_group: the pool has a window group of layers with
        pages of its own (jaxpage.kv_cache.HybridKVCache), whose slot mapping and block tables steps carry too;
        lora_slot: one LoRA slot's weights, zeros (jaxpage.worker.lora_weights.LoRAWeights.template), the arrays of a
        LORA message; steps then carry each token's LoRA slot (StepInput.lora_slots). None: LoRA is off."""
        self.window_group = window_group
        self.lora_slot = lora_slot
        self.num_pool_groups = 2 if window_group else 1
        self.shapes = shapes
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # Block tables have one width: attention reads each only up to its sequence's kv length.
        self.block_table_width = math.ceil(max_model_len / page_size)
        self.data_parallel_size = data_parallel_size
        self.stack = stack
        self.draft_vocab_size = draft_vocab_size
        self.max_sample_rows = max(shape.sample_rows for shape in shapes)  # the rows of fed_tokens

    def shape_for(self, *outputs: SchedulerOutput) -> StepShape:
        """The smallest shape of the step's kind that holds it (or each data-parallel replica's step, all padded to
        one shape): verify if some sequence brings draft tokens (the scheduler keeps those to steps without
        prefill; speculative decoding runs without data parallelism), else decode if every sequence has one new
        token, else mixed."""
        rows = max(len(output.scheduled) for output in outputs)
        if any(output.num_draft_tokens for output in outputs):
            return self.smallest_shape("verify", rows)
        if all(output.num_batched_tokens == len(output.scheduled) for output in outputs):  # (each has one at least)
            return self.smallest_shape("decode", rows)
        return self.smallest_shape("mixed", max(output.num_batched_tokens for output in outputs), rows)

    def smallest_shape(self, kind: str, size: int, rows: int = 0) -> StepShape:
        """The smallest shape of `kind` for `size` sequences (decode, verify) or tokens and `rows` sequences
        (mixed)."""
        if kind == "mixed":
            return next(s for s in self.shapes if s.kind == kind and s.num_tokens >= size and s.num_rows >= rows)
        return next(s for s in self.shapes if s.kind == kind and s.num_rows >= size)

    @staticmethod
    def processor_level(*outputs: SchedulerOutput) -> int:
        """The sampler variant the step (every replica's part of it) needs: PENALTIES if a sampling row uses a
        penalty, else MASKS if one has other logits processors, else NO_PROCESSORS."""
        return max(o.max_sampled(PROCESSOR_LEVEL_COLUMN) for o in outputs)

    def prepare(
        self,
        output: SchedulerOutput,
        shape: StepShape,
        level: int = NO_PROCESSORS,
        pending_rows: dict[int, int] | None = None,
    ) -> tuple[StepInput, SampleInput]:
        """The step's arrays (numpy), padded to `shape`: the forward pass's and the sampler's (with a draft model's
        distributions, for a verify step with drafts from a draft model), with logits processors' arrays as
        `level` says (see processor_level). pending_rows: by seq_id, the row of the launched step before this one
        that samples the sequence's pending token (asynchronous scheduling), which this step then reads from the
        device."""
        items = output.scheduled
        page_size, k, num_items = self.page_size, shape.num_draft_positions, len(items)
        assert num_items <= shape.num_rows, (num_items, shape)
        token_ids = np.zeros(shape.num_tokens, np.int32)
        feed_index = np.full(shape.num_tokens, -1, np.int32)
        positions = np.zeros(shape.num_tokens, np.int32)
        slot_mapping = np.zeros(shape.num_tokens, np.int32)  # padding tokens write into the null page
        cu_q_lens = np.zeros(shape.num_rows + 1, np.int32)
        kv_lens = np.zeros(shape.num_rows, np.int32)
        block_tables = np.zeros((shape.num_rows, self.block_table_width), np.int32)
        window = self.window_group
        window_slots = np.zeros(shape.num_tokens, np.int32) if window else None
        window_tables = np.zeros((shape.num_rows, self.block_table_width), np.int32) if window else None
        logits_indices = np.zeros((shape.sample_rows, k + 1), np.int32)
        draft_tokens = np.zeros((shape.sample_rows, k), np.int32)
        num_drafts = np.zeros(shape.sample_rows, np.int32)
        if items:
            computed_tokens = [item.num_computed_tokens for item in items]
            computed = np.array(computed_tokens, np.int32)
            counts = np.array([item.num_new_tokens for item in items], np.int32)
            assert shape.max_q_len == 0 or counts.max() <= shape.max_q_len, shape
            drafted = np.array([len(item.draft_token_ids) for item in items], np.int32) if k else counts * 0
            ends = np.cumsum(counts, dtype=np.int32)
            starts, total = ends - counts, int(ends[-1])
            cu_q_lens[1 : num_items + 1], cu_q_lens[num_items + 1 :] = ends, total
            kv_lens[:num_items] = computed + counts
            rows = np.repeat(np.arange(num_items), counts)  # each token's item
            positions[:total] = np.repeat(computed - starts, counts) + np.arange(total, dtype=np.int32)
            self._fill_tokens(items, computed_tokens, starts, counts, token_ids, feed_index, pending_rows)
            tables, window_held = output.block_tables, output.window_block_tables
            if tables is None:  # an output made by hand: the sequences' lists
                tables = table_rows([item.seq.block_table for item in items])
                window_held = table_rows([item.seq.window_block_table for item in items]) if window else None
            width = min(tables.shape[1], self.block_table_width)
            block_tables[:num_items, :width] = tables[:, :width]
            pos = positions[:total]
            slot_mapping[:total] = block_tables[rows, pos // page_size] * page_size + pos % page_size
            if window:  # the null page before the window
                window_tables[:num_items, :width] = window_held[:, :width]
                window_slots[:total] = window_tables[rows, pos // page_size] * page_size + pos % page_size
            # The last known token's logits, then each draft token's (repeated past the row's drafts).
            known_ends = ends - drafted
            logits_indices[:num_items] = (known_ends - 1)[:, None] + np.minimum(np.arange(k + 1), drafted[:, None])
            num_drafts[:num_items] = drafted
            for row in np.flatnonzero(drafted).tolist():
                draft_tokens[row, : drafted[row]] = items[row].draft_token_ids
        known = kv_lens[:num_items] - drafted if items else None
        sampling = row_sampling(items, shape.sample_rows, output.sampler_rows, output.idle_rows, known)
        want_logprobs = output.max_sampled(LOGPROBS_COLUMN) > 0
        attention = PagedBatch(
            slot_mapping, block_tables, kv_lens, cu_q_lens, np.int32(len(items)), window_slots, window_tables
        )
        prompt_indices = np.zeros(PROMPT_LOGPROB_TOKENS, np.int32)
        rows = output.prompt_logprob_rows
        assert len(rows) <= PROMPT_LOGPROB_TOKENS, len(rows)  # the scheduler keeps them within
        prompt_indices[: len(rows)] = [token for _, token, _ in rows]
        fed_tokens = np.zeros(self.max_sample_rows, np.int32)
        lora_slots = token_lora_slots(items, shape.num_tokens) if self.lora_slot else None
        indices = (logits_indices.reshape(-1), prompt_indices, feed_index, fed_tokens)
        step = StepInput(token_ids, positions, attention, *indices, lora_slots)
        logits = self.logits_inputs(items, shape.sample_rows, k, level) if level != NO_PROCESSORS else None
        return step, SampleInput(sampling, np.bool_(want_logprobs), draft_tokens, num_drafts, logits=logits)

    @staticmethod
    def _fill_tokens(
        items: list[ScheduledSequence], computed: list[int], starts, counts, token_ids, feed_index, pending
    ):
        """The step's tokens into token_ids (items' computed tokens, where each item's tokens start in the step, how
        many it has): each item's known tokens, then a pending one (read on the device: its feed_index is the row of the
        step before that samples it), then its drafts."""
        lists = [item.seq.token_ids for item in items]
        # Every item's first token (-1: pending), then the rest of the items with more (prompts, drafts).
        firsts = [t[c] if c < len(t) else -1 for t, c in zip(lists, computed, strict=True)]
        token_ids[starts] = firsts
        for row in [row for row, token in enumerate(firsts) if token == -1] if -1 in firsts else ():
            item, start = items[row], int(starts[row])
            if item.num_new_tokens == 1:  # a pending token, read from the device
                assert item.seq.controls is None, item  # controls need the tokens here
                token_ids[start], feed_index[start] = 0, pending[item.seq.seq_id]
        for row in np.flatnonzero(counts > 1).tolist():
            item, start = items[row], int(starts[row])
            seq, c, n, drafts = item.seq, computed[row], item.num_new_tokens, item.draft_token_ids
            known = n - len(drafts)  # the sequence's own tokens, then the drafts
            host = max(0, min(known, len(seq.token_ids) - c))  # the tokens this host knows, then a pending one
            token_ids[start : start + host] = seq.token_ids[c : c + host]
            if host < known:
                assert known - host == 1 and seq.controls is None, (item, host)  # controls need the tokens here
                token_ids[start + host], feed_index[start + host] = 0, pending[seq.seq_id]
            token_ids[start + known : start + n] = drafts

    def prompt_targets(self, output: SchedulerOutput) -> np.ndarray:
        """[PROMPT_LOGPROB_TOKENS] int32: the prompt token each row of prompt log-probs is asked about (0 past
        them), in prompt_logprob_rows' order."""
        targets = np.zeros(PROMPT_LOGPROB_TOKENS, np.int32)
        rows = output.prompt_logprob_rows
        targets[: len(rows)] = [output.scheduled[i].seq.token_ids[position] for i, _, position in rows]
        return targets

    def prompt_targets_template(self):
        """A PROMPT_LOGPROBS message's arrays: each replica's prompt targets (prompt_targets), stacked."""
        return self.stacked([np.zeros(PROMPT_LOGPROB_TOKENS, np.int32)] * self.data_parallel_size)

    def unpack(self, header: Header, data: bytes):
        """The arrays of a message process 0 sent (jaxpage.worker.step_broadcast), as ModelRunner.run takes them;
        None for a message without any."""
        if header.kind is Message.COPY:
            return unpack(data, (np.zeros((self.num_pool_groups, header.key), np.int32),) * 2)
        if header.kind in (Message.OFFLOAD, Message.LOAD):  # each replica's ids
            return unpack(data, (np.zeros((self.data_parallel_size, TRANSFER_CHUNK), np.int32),) * 2)
        if header.kind is Message.FORWARD:
            return unpack(data, self.template(self.shapes[header.key])[0])
        if header.kind is Message.STEP:  # flag: see step_flag
            return unpack(data, self.template(self.shapes[header.key], split_step_flag(header.flag)[0]))
        if header.kind is Message.PROMPT_LOGPROBS:
            return unpack(data, self.prompt_targets_template())
        if header.kind is Message.LORA:
            return unpack(data, self.lora_slot)
        return None

    def payload_sizes(self) -> set[int]:
        """The bytes of the arrays of every message a runner can send (jaxpage.worker.step_broadcast): page copies,
        the host tier's transfers, forward passes, steps (with each level of logits processors), prompt log-probs, a
        LoRA slot's weights."""

        def size(tree) -> int:
            return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))

        sizes = {
            2 * self.num_pool_groups * COPY_CHUNK * np.dtype(np.int32).itemsize,
            2 * self.data_parallel_size * TRANSFER_CHUNK * np.dtype(np.int32).itemsize,
            size(self.prompt_targets_template()),
            size(self.lora_slot),
        }
        for shape in self.shapes:
            for level in PROCESSOR_LEVELS:
                step, sample_input = self.template(shape, level)
                sizes |= {size(step), size((step, sample_input))}
        return sizes

    def logits_inputs(self, items: list[ScheduledSequence], num_rows: int, k: int, level: int) -> LogitsInputs:
        """The logits processors' arrays of the sampling items (jaxpage.sample.logits_controls), a row per item and
        position: row i * (k + 1) + j is item i's token after its first j draft tokens (so a row's grammar mask,
        bad words, min_tokens and penalties count those drafts). Rows of items without controls allow everything
        and change nothing."""
        positions = k + 1
        n = num_rows * positions
        allowed = np.full((n, bitmask_words(self.vocab_size)), -1, np.int32)
        bias_ids = np.zeros((n, SamplingParams.MAX_LOGIT_BIAS), np.int32)
        bias_values = np.zeros((n, SamplingParams.MAX_LOGIT_BIAS), np.float32)
        penalties = None
        if level == PENALTIES:
            penalties = PenaltyInputs(
                np.full((n, self.max_model_len), -1, np.int32),
                np.zeros(n, np.int32),
                np.zeros(n, np.float32),
                np.zeros(n, np.float32),
                np.ones(n, np.float32),
            )
        controlled = [(i, item) for i, item in enumerate(items) if item.samples and item.seq.controls is not None]
        grammar_rows = [
            (item.seq.controls.matcher, i * positions, list(item.draft_token_ids))
            for i, item in controlled
            if item.seq.controls.matcher is not None
        ]
        fill_grammar_bitmasks(grammar_rows, allowed)
        for i, item in controlled:
            seq, controls, drafts = item.seq, item.seq.controls, list(item.draft_token_ids)
            output = seq.output_token_ids
            for j in range(positions):
                row = i * positions + j
                context = drafts[: min(j, len(drafts))]
                if j > len(drafts):  # past the row's drafts: verification does not use it; keep it sane
                    allowed[row] = allowed[i * positions + len(drafts)]
                controls.restrict(allowed[row], output + context)
                count = len(controls.bias_ids)
                bias_ids[row, :count] = controls.bias_ids
                bias_values[row, :count] = controls.bias_values
                if penalties is not None and controls.uses_penalties:
                    tokens = (seq.token_ids + context)[: self.max_model_len]
                    penalties.token_ids[row, : len(tokens)] = tokens
                    penalties.num_prompt_tokens[row] = seq.num_prompt_tokens
                    penalties.presence[row] = controls.presence_penalty
                    penalties.frequency[row] = controls.frequency_penalty
                    penalties.repetition[row] = controls.repetition_penalty
        return LogitsInputs(allowed, bias_ids, bias_values, penalties)

    def padding(self, shape: StepShape, level: int = NO_PROCESSORS) -> tuple[StepInput, SampleInput]:
        """A step of `shape` with no sequence in it (for every replica, stacked, on several devices), with a draft
        model's distributions (zeros) where its verify steps take them, and logits processors' arrays as `level`
        says."""
        step, inputs = self.template(shape, level)
        k = shape.num_draft_positions
        if self.draft_vocab_size and k:
            probs = np.zeros((shape.sample_rows, k, self.draft_vocab_size), np.float32)
            inputs = dataclasses.replace(inputs, draft_probs=self.stacked([probs] * self.data_parallel_size))
        return step, inputs

    def template(self, shape: StepShape, level: int = NO_PROCESSORS) -> tuple[StepInput, SampleInput]:
        """The arrays of a step of `shape` with no sequence in it, for every replica (stacked, on several devices),
        without a draft model's distributions, with logits processors' arrays as `level` says."""
        empty = self.prepare(SchedulerOutput(scheduled=[], page_copies=[]), shape, level)
        return self.stacked([empty] * self.data_parallel_size)

    def stacked(self, per_replica: list):
        """On several devices: the replicas' step arrays stacked on a leading axis (spec REPLICAS); on one, the one
        replica's as they are."""
        if not self.stack:
            return per_replica[0]
        assert len(per_replica) == self.data_parallel_size, (len(per_replica), self.data_parallel_size)
        return jax.tree.map(lambda *xs: np.stack(xs), *per_replica)
