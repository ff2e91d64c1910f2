"""The step shapes: every step has one, the largest is the token budget, and there are few of them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from jaxpage.worker.step_inputs import StepInputs
from jaxpage.worker.step_shapes import StepShape, bucket_for, powers_of_two, step_shapes


@given(st.integers(1, 4096), st.integers(1, 8192))
def test_every_step_has_a_shape(max_num_seqs, max_num_batched_tokens):
    shapes = step_shapes(max_num_seqs, max_num_batched_tokens)
    assert len(set(shapes)) == len(shapes)
    decode = [s.num_tokens for s in shapes if s.kind == "decode"]
    mixed = [s.num_tokens for s in shapes if s.kind == "mixed"]
    assert {s.kind for s in shapes} == {"decode", "mixed"}  # no verify shapes without speculative decoding
    assert decode == sorted(decode) and mixed == sorted(mixed)
    assert decode[-1] == min(max_num_seqs, max_num_batched_tokens)  # the most decodes a step can hold
    assert mixed[-1] == max_num_batched_tokens
    sample_rows = sorted({s.sample_rows for s in shapes})
    assert sample_rows[-1] == decode[-1]
    for shape in shapes:
        small = shape.kind == "mixed" and shape.num_tokens in (16, 64) and shape.num_rows == min(4, max_num_seqs)
        rows = shape.num_tokens if shape.kind == "decode" else min(shape.num_tokens, max_num_seqs)
        assert shape.num_rows == rows or small
        assert shape.sample_rows == bucket_for(shape.num_rows, sample_rows)  # the sampler's rows: its own buckets
        assert shape.sample_rows < 4 * shape.num_rows or shape.sample_rows == 8
    for n in {min(k, decode[-1]) for k in (1, 2, 3, decode[-1] // 2 + 1, decode[-1])}:  # 2x padding at most, past 4
        bucket = bucket_for(n, decode)
        assert n <= bucket and (bucket < 2 * n or bucket <= 4)
        if 16 < n <= 48:  # 1.5x steps between 16 and 64
            assert bucket * 2 < 3 * n + 3
    for n in {min(2, max_num_batched_tokens), max_num_batched_tokens // 2 + 1, max_num_batched_tokens}:
        assert bucket_for(n, mixed) >= n


def test_the_default_arguments_compile_sixteen_programs():
    shapes = step_shapes(max_num_seqs=64, max_num_batched_tokens=512)
    assert [str(s) for s in shapes] == [
        "decode(T=1, S=1, R=1)",  # one request alone: no padding row, an LM head of one row
        "decode(T=4, S=4, R=8)",
        "decode(T=8, S=8, R=8)",
        "decode(T=16, S=16, R=32)",
        "decode(T=24, S=24, R=32)",
        "decode(T=32, S=32, R=32)",
        "decode(T=48, S=48, R=64)",
        "decode(T=64, S=64, R=64)",
        "mixed(T=16, S=4, R=8)",  # a short prompt, few sequences
        "mixed(T=64, S=4, R=8)",
        "mixed(T=128, S=64, R=64)",
        "mixed(T=512, S=64, R=64)",
    ]
    assert StepShape(4, 4, 8, 1) in shapes
    assert len(shapes) + len({s.sample_rows for s in shapes}) == 16  # 12 forward passes, 4 samplers


def test_a_mixed_step_takes_the_smallest_shape_that_holds_its_tokens_and_its_sequences():
    inputs = StepInputs(step_shapes(64, 512), page_size=16, max_model_len=1024, data_parallel_size=1, stack=False)
    assert str(inputs.smallest_shape("mixed", 16, 1)) == "mixed(T=16, S=4, R=8)"  # a short prompt alone
    assert str(inputs.smallest_shape("mixed", 20, 1)) == "mixed(T=64, S=4, R=8)"
    assert str(inputs.smallest_shape("mixed", 64, 4)) == "mixed(T=64, S=4, R=8)"
    assert str(inputs.smallest_shape("mixed", 20, 5)) == "mixed(T=128, S=64, R=64)"  # more sequences than 4
    assert str(inputs.smallest_shape("mixed", 65, 1)) == "mixed(T=128, S=64, R=64)"
    assert str(inputs.smallest_shape("decode", 2)) == "decode(T=4, S=4, R=8)"


@given(st.integers(1, 512), st.integers(1, 4096), st.integers(1, 16), st.integers(1, 512))
def test_verify_shapes_hold_k_plus_one_rows_per_sequence(max_num_seqs, max_num_batched_tokens, k, max_verify_rows):
    shapes = step_shapes(max_num_seqs, max_num_batched_tokens, k, max_verify_rows)
    plain = step_shapes(max_num_seqs, max_num_batched_tokens)
    assert shapes[: len(plain)] == plain  # speculation adds verify shapes, changes none
    verify = shapes[len(plain) :]
    rows = [s.num_rows for s in verify]
    most = min(max_verify_rows, max_num_seqs, max_num_batched_tokens)
    assert rows == sorted(rows) and rows[0] == 1 and rows[-1] == most
    for shape in verify:
        assert shape.kind == "verify" and shape.num_draft_positions == k and shape.max_q_len == k + 1
        assert shape.num_tokens == shape.num_rows * (k + 1) and shape.sample_rows == shape.num_rows
    for n in range(1, most + 1):  # 2x padding of rows at most
        assert bucket_for(n, rows) < 2 * n


def test_speculation_adds_verify_shapes():
    shapes = step_shapes(max_num_seqs=64, max_num_batched_tokens=512, num_speculative_tokens=4, max_verify_rows=16)
    assert [str(s) for s in shapes if s.kind == "verify"] == [
        "verify(T=5, S=1, R=1, k=4)",
        "verify(T=10, S=2, R=2, k=4)",
        "verify(T=20, S=4, R=4, k=4)",
        "verify(T=40, S=8, R=8, k=4)",
        "verify(T=80, S=16, R=16, k=4)",
    ]


def test_powers_of_two_end_at_the_maximum():
    assert powers_of_two(4, 64) == [4, 8, 16, 32, 64]
    assert powers_of_two(4, 100) == [4, 8, 16, 32, 64, 100]
    assert powers_of_two(64, 32) == [32]
    assert powers_of_two(4, 64, factor=4) == [4, 16, 64]
