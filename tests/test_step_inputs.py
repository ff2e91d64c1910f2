"""A step's host arrays (jaxpage.worker.step_inputs), built with numpy from the block manager's table rows, against a
row-by-row reference that reads each sequence's own lists: random mixes of prefill chunks, decodes, pending tokens
(asynchronous scheduling) and drafts."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpage.engine.block_tables import BlockTables
from jaxpage.sample.logits_controls import LogitsControls
from jaxpage.sampling_params import SamplingParams
from jaxpage.sequence import ScheduledSequence, SchedulerOutput, Sequence
from jaxpage.worker.step_inputs import MASKS, NO_PROCESSORS, PENALTIES, StepInputs
from jaxpage.worker.step_shapes import step_shapes

PAGE_SIZE, MAX_MODEL_LEN, VOCAB = 4, 64, 100


def reference_arrays(items: list[ScheduledSequence], shape, pending_rows: dict[int, int], width: int) -> dict:
    """What a step's arrays hold, one row at a time from each sequence's token and block-table lists."""
    k = shape.num_draft_positions
    arrays = {
        "token_ids": np.zeros(shape.num_tokens, np.int32),
        "feed_index": np.full(shape.num_tokens, -1, np.int32),
        "positions": np.zeros(shape.num_tokens, np.int32),
        "slot_mapping": np.zeros(shape.num_tokens, np.int32),
        "cu_q_lens": np.zeros(shape.num_rows + 1, np.int32),
        "kv_lens": np.zeros(shape.num_rows, np.int32),
        "block_tables": np.zeros((shape.num_rows, width), np.int32),
        "logits_indices": np.zeros((shape.sample_rows, k + 1), np.int32),
        "draft_tokens": np.zeros((shape.sample_rows, k), np.int32),
        "num_drafts": np.zeros(shape.sample_rows, np.int32),
    }
    start = 0
    for row, item in enumerate(items):
        seq, computed, n, drafts = item.seq, item.num_computed_tokens, item.num_new_tokens, item.draft_token_ids
        known = n - len(drafts)
        host = max(0, min(known, len(seq.token_ids) - computed))
        arrays["token_ids"][start : start + host] = seq.token_ids[computed : computed + host]
        if host < known:
            arrays["feed_index"][start + host] = pending_rows[seq.seq_id]
        arrays["token_ids"][start + known : start + n] = drafts
        for i in range(n):
            position = computed + i
            arrays["positions"][start + i] = position
            page = seq.block_table[position // PAGE_SIZE]
            arrays["slot_mapping"][start + i] = page * PAGE_SIZE + position % PAGE_SIZE
        arrays["block_tables"][row, : len(seq.block_table)] = seq.block_table
        arrays["kv_lens"][row] = computed + n
        for j in range(k + 1):
            arrays["logits_indices"][row, j] = start + known - 1 + min(j, len(drafts))
        arrays["draft_tokens"][row, : len(drafts)] = drafts
        arrays["num_drafts"][row] = len(drafts)
        start += n
        arrays["cu_q_lens"][row + 1] = start
    arrays["cu_q_lens"][len(items) + 1 :] = start
    return arrays


@st.composite
def steps(draw):
    """(items, pending_rows): sequences each holding pages for their tokens, each scheduled for a prefill chunk, a
    decode (its last token known or pending) or, in a verify step, a decode with drafts."""
    verify = draw(st.booleans())
    num_items = draw(st.integers(0, 6))
    pages = iter(draw(st.permutations(range(1, 200))))
    items, pending_rows = [], {}
    for seq_id in range(num_items):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
        outputs = draw(st.lists(st.integers(0, VOCAB - 1), max_size=8))
        extra = draw(st.sampled_from([{}, {"allowed_token_ids": [1, 2, 3]}, {"presence_penalty": 0.5}]))
        params = SamplingParams(seed=seq_id, logprobs=draw(st.sampled_from([None, 2])), **extra)
        controls = LogitsControls.of(params, VOCAB, [2], [])  # (none, a mask, or a penalty)
        seq = Sequence(seq_id, prompt, token_ids=prompt + outputs, sampling_params=params, seed=seq_id)
        seq.controls = controls
        pending = draw(st.booleans()) and not verify and outputs and controls is None  # (controls need the tokens)
        if pending:  # its last token comes from the step before, on the device
            seq.num_pending_tokens = 1
            pending_rows[seq_id] = draw(st.integers(0, 7))
        total = len(seq.token_ids) + seq.num_pending_tokens
        if verify:
            computed, drafts = total - 1, tuple(draw(st.lists(st.integers(0, VOCAB - 1), max_size=3)))
            n = 1 + len(drafts)
        else:
            computed = draw(st.integers(0, total - 1))
            n, drafts = draw(st.integers(1, total - computed)), ()
        seq.block_table = [next(pages) for _ in range(-(-(computed + n) // PAGE_SIZE))]
        seq.num_computed_tokens = computed
        items.append(ScheduledSequence.of(seq, n, drafts))
    return items, pending_rows, verify


@settings(max_examples=150, deadline=None)
@given(steps())
def test_step_arrays_equal_the_row_by_row_reference(step):
    items, pending_rows, verify = step
    shapes = step_shapes(8, 64, num_speculative_tokens=3 if verify else 0, max_verify_rows=8 if verify else 0)
    inputs = StepInputs(shapes, PAGE_SIZE, MAX_MODEL_LEN, 1, stack=False, vocab_size=VOCAB)
    tables = BlockTables(rows=2, width=2)  # (grows as it must)
    for item in items:
        tables.assign(item.seq.seq_id, item.seq.sampler_row)
        tables.write(item.seq.seq_id, item.seq.block_table)
    gathered = tables.gather_with_sampling([item.seq.seq_id for item in items]) if items else (None, None)
    for block_tables, sampler_rows in ((None, None), gathered):  # the sequences' lists, or the block manager's rows
        output = SchedulerOutput(items, [], block_tables=block_tables, sampler_rows=sampler_rows)
        shape = inputs.shape_for(output)
        step, sample_input = inputs.prepare(output, shape, pending_rows=pending_rows)
        expected = reference_arrays(items, shape, pending_rows, inputs.block_table_width)
        attention = step.attention
        actual = {
            "token_ids": step.token_ids,
            "feed_index": step.feed_index,
            "positions": step.positions,
            "slot_mapping": attention.slot_mapping,
            "cu_q_lens": attention.cu_q_lens,
            "kv_lens": attention.kv_lens,
            "block_tables": attention.block_tables,
            "logits_indices": step.logits_indices.reshape(shape.sample_rows, -1),
            "draft_tokens": sample_input.draft_tokens,
            "num_drafts": sample_input.num_drafts,
        }
        for name, array in expected.items():
            np.testing.assert_array_equal(actual[name], array, err_msg=name)
        sampling = sample_input.sampling
        for row, item in enumerate(items):
            params, seq = item.seq.sampling_params, item.seq
            assert sampling.temperature[row] == (params.temperature if item.samples else 0.0)
            assert sampling.seeds[row] == seq.seed and sampling.steps[row] == seq.num_output_tokens
        assert not sampling.temperature[len(items) :].any() and (sampling.top_p[len(items) :] == 1).all()
        sampled = [item.seq for item in items if item.samples]  # what the sampler side reads of the rows that sample
        assert bool(sample_input.want_logprobs) == any(seq.sampling_params.logprobs is not None for seq in sampled)
        controls = [seq.controls for seq in sampled if seq.controls is not None]
        level = PENALTIES if any(c.uses_penalties for c in controls) else MASKS if controls else NO_PROCESSORS
        assert inputs.processor_level(output) == level


def test_block_tables_grow_and_give_back_their_rows():
    tables = BlockTables(rows=1, width=1)
    tables.write(7, [3, 4, 5])  # wider than the array
    tables.write(8, [6])  # a second row
    tables.write(7, [3])  # shorter: the rest is the null page again
    np.testing.assert_array_equal(tables.gather([8, 7]), [[6, 0, 0, 0], [3, 0, 0, 0]])
    tables.release(7)
    tables.write(9, [1, 2])  # takes the row 7 gave back
    tables.check({8: [6], 9: [1, 2]})
    assert tables.array.shape[0] == 2


def test_block_tables_hold_each_rows_sampler_settings_until_it_is_given_back():
    """A row's sampler settings and seed (Sequence.sampler_row) stay in place from step to step; a row given back
    and taken again holds none (a gather then gives None, so a step reads the sequences) until assigned again."""
    tables = BlockTables(rows=1, width=1)
    tables.assign(7, (0.8, 40, 0.9, 0.0, 7, 12, 1, 0))
    tables.write(7, [3, 4])
    tables.assign(8, (0.0, 0, 1.0, 0.0, 2**32 - 1, 3, 0, 2))  # a second row (the arrays grow)
    tables.assign(7, (1.5, 0, 1.0, 0.0, 9, 5, 0, 0))  # it has a row: kept as it was
    rows, sampling = tables.gather_with_sampling([8, 7])
    np.testing.assert_array_equal(rows, [[0, 0], [3, 4]])
    expected = [[0.0, 0, 1.0, 0.0, 2**32 - 1, 3, 0, 2], [0.8, 40, 0.9, 0.0, 7, 12, 1, 0]]
    np.testing.assert_array_equal(sampling, expected)
    tables.release(7)
    tables.write(9, [5])  # row 7's, without settings
    assert tables.gather_with_sampling([8, 9])[1] is None
    tables.check({8: [], 9: [5]})
