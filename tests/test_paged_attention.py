"""Decode paged attention: the Pallas TPU and GPU kernels (natively on their backend, else in Pallas' generic
interpreter) and the XLA implementation against the dense reference, with NaN-poisoned stale slots and free pages."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import ragged_paged_attention_dense_reference
from jax.experimental.pallas import tpu as pltpu
from test_ragged_paged_attention import (
    IMPLS,
    LAYOUTS,
    MAX_KV,
    NUM_SEQ_ROWS,
    Layout,
    make_batch,
    sm_scale,
    while_loops,
    with_impls,
)

from pallas_kernels.gpu_decode_attention import gpu_decode_attention
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.xla_ragged_attention import xla_ragged_attention

KERNELS = ["pallas-tpu", "pallas-gpu"]
NOT_HERE = "gpu" if jax.default_backend() == "tpu" else "tpu"  # a kernel backend that is not this machine's
pytestmark = pytest.mark.filterwarnings("ignore:the TPU kernels need the KV pool's head_dim padded")  # see there


def decode_case(page_size: int) -> list[tuple[int, int]]:
    """(q_len, kv_len) of the live rows: kv lengths 0, 1, page_size - 1, page_size, page_size + 1 and long."""
    return [(0, 0), (1, 1), (1, page_size - 1), (1, page_size), (1, page_size + 1), (1, 100), (1, MAX_KV)]


def decode_args(batch):
    """The decode function's arguments from a ragged test batch whose live rows all have q_len 1 (or 0): row s of
    q is sequence s's query (0 for rows without one)."""
    cu_q_lens = np.asarray(batch.cu_q_lens)
    has_query = (cu_q_lens[1:] - cu_q_lens[:-1]) == 1
    q = jnp.where(has_query[:, None, None], batch.q[np.minimum(cu_q_lens[:-1], batch.q.shape[0] - 1)], 0)
    return q, batch.k_pages, batch.v_pages, batch.kv_lens, batch.block_tables


def expected(batch, **kwargs) -> np.ndarray:
    q, k_pages, v_pages, kv_lens, block_tables = decode_args(batch)
    cu_q_lens = jnp.asarray(np.concatenate([[0], np.cumsum(np.asarray(kv_lens) > 0)]), jnp.int32)
    rows = np.asarray(kv_lens) > 0
    # The plain reference takes query rows back to back: give it the live rows only, then put them back in place.
    out = np.zeros(q.shape, np.float32)
    live = ragged_paged_attention_dense_reference(
        q[np.flatnonzero(rows)], k_pages, v_pages, kv_lens, block_tables, cu_q_lens, jnp.int32(len(rows)), **kwargs
    )
    out[rows] = np.asarray(live, np.float32)
    return out


def assert_close(layout: Layout, got: jax.Array, want: np.ndarray) -> None:
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=layout.atol, rtol=0 if layout.dtype == jnp.float32 else 2e-2)


# In the interpreter the TPU kernel runs MHA, MQA and bfloat16 with head_dim 128.
@pytest.mark.parametrize(("layout", "impl"), with_impls(LAYOUTS, [LAYOUTS[0], LAYOUTS[3], LAYOUTS[4]]), ids=str)
def test_matches_reference_with_poisoned_pages(layout, impl):
    # Every slot that holds no live position (stale slots, the null page, spare pages) is NaN.
    batch = make_batch(layout, decode_case(layout.page_size), poison=True)
    kwargs = dict(sm_scale=sm_scale(layout))
    got = paged_attention(*decode_args(batch), **kwargs, **IMPLS[impl])
    assert got.shape == (NUM_SEQ_ROWS, layout.num_heads, layout.head_dim) and got.dtype == layout.dtype
    assert_close(layout, got, expected(batch, **kwargs))


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize(("sliding_window", "soft_cap"), [(5, None), (None, 1.5), (20, 2.0)])
def test_sliding_window_and_soft_cap(sliding_window, soft_cap, impl):
    layout = LAYOUTS[1]
    batch = make_batch(layout, decode_case(layout.page_size), seed=2, poison=True)
    kwargs = dict(sm_scale=sm_scale(layout), sliding_window=sliding_window, soft_cap=soft_cap)
    got = paged_attention(*decode_args(batch), **kwargs, **IMPLS[impl])
    assert_close(layout, got, expected(batch, **kwargs))


@pytest.mark.parametrize(("num_splits", "pages_per_kv_tile"), [(1, 1), (2, 2), (4, 1), (8, 1)])
def test_gpu_kernel_splits_and_kv_tiles(num_splits, pages_per_kv_tile):
    # Page size 8, 16 pages a table: 8 splits leave 2 pages each, so most splits of short sequences are empty.
    layout = LAYOUTS[0]
    batch = make_batch(layout, decode_case(layout.page_size), seed=3, poison=True, share_pages=0)
    kwargs = dict(sm_scale=sm_scale(layout), soft_cap=None, sliding_window=None)
    interpret = IMPLS["pallas-gpu"]["interpret"]
    got = gpu_decode_attention(
        *decode_args(batch), **kwargs, num_splits=num_splits, pages_per_kv_tile=pages_per_kv_tile, interpret=interpret
    )
    assert_close(layout, got, expected(batch, sm_scale=sm_scale(layout)))


@pytest.mark.parametrize("impl", KERNELS)
def test_shared_prefix_pages(impl):
    layout = LAYOUTS[1]
    p = layout.page_size
    batch = make_batch(layout, [(1, 3 * p + 2), (1, 2 * p + 7)], share_pages=2, poison=True)
    assert (np.asarray(batch.block_tables)[0, :2] == np.asarray(batch.block_tables)[1, :2]).all()
    kwargs = dict(sm_scale=sm_scale(layout))
    assert_close(
        layout,
        paged_attention(*decode_args(batch), **kwargs, **IMPLS[impl]),
        expected(batch, **kwargs),
    )


def test_one_layer_of_a_stacked_pool():
    layout = LAYOUTS[1]
    layers = [make_batch(layout, decode_case(layout.page_size), seed=s) for s in range(3)]
    k_pool = jnp.stack([b.k_pages for b in layers])
    v_pool = jnp.stack([b.v_pages for b in layers])
    q, _, _, kv_lens, block_tables = decode_args(layers[0])
    kwargs = dict(sm_scale=sm_scale(layout))
    for impl in IMPLS.values():
        run = functools.partial(paged_attention, **kwargs, **impl)
        got = run(q, k_pool, v_pool, kv_lens, block_tables, layer=jnp.int32(2))
        want = expected(dataclasses.replace(layers[0], k_pages=layers[2].k_pages, v_pages=layers[2].v_pages), **kwargs)
        assert_close(layout, got, want)


def test_auto_is_the_platforms_kernel_or_xla_on_cpu():
    layout = LAYOUTS[1]
    batch = make_batch(layout, decode_case(layout.page_size))
    kwargs = dict(sm_scale=sm_scale(layout))
    auto = paged_attention(*decode_args(batch), **kwargs)
    expected = "xla" if jax.default_backend() == "cpu" else "pallas"
    np.testing.assert_array_equal(
        np.asarray(auto), np.asarray(paged_attention(*decode_args(batch), **kwargs, impl=expected))
    )


def test_xla_decode_compiles_no_prefill_loop():
    # impl="xla" runs the XLA implementation with max_q_len=1: the same while loops, none for prefill rows.
    batch = make_batch(LAYOUTS[1], decode_case(LAYOUTS[1].page_size))
    q, k_pages, v_pages, kv_lens, block_tables = decode_args(batch)
    decode = while_loops(functools.partial(paged_attention, sm_scale=0.2, impl="xla"), *decode_args(batch))
    metadata = (kv_lens, block_tables, jnp.arange(NUM_SEQ_ROWS + 1, dtype=jnp.int32), jnp.int32(NUM_SEQ_ROWS))
    general = while_loops(functools.partial(xla_ragged_attention, sm_scale=0.2), q, k_pages, v_pages, *metadata)
    decode_only = functools.partial(xla_ragged_attention, sm_scale=0.2, max_q_len=1)
    assert decode == while_loops(decode_only, q, k_pages, v_pages, *metadata) < general


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(impl="triton"), "impl must be one of"),
        (dict(backend="cuda"), "backend must be None or one of"),
        (dict(impl="pallas", backend=NOT_HERE, interpret=False), "needs interpret=True"),
        (dict(backend="gpu", interpret=pltpu.InterpretParams()), "TPU interpret mode"),
        pytest.param(
            dict(impl="pallas", backend=None, interpret=True),
            "backend='tpu' or 'gpu'",
            marks=pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU-only refusal"),
        ),
        (dict(q=lambda b: b.q[:NUM_SEQ_ROWS, :, :-1]), "head_dim"),
        (dict(q=lambda b: b.q[: NUM_SEQ_ROWS - 1]), r"kv_lens \[S\]"),
        (dict(block_tables=lambda b: b.block_tables.astype(jnp.float32)), "block_tables must be int32"),
        (dict(sliding_window=0), "sliding_window must be positive"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_arguments_raise_value_error(change, message):
    layout = LAYOUTS[1]
    batch = make_batch(layout, decode_case(layout.page_size))
    q, k_pages, v_pages, kv_lens, block_tables = decode_args(batch)
    args = dict(q=q, k_pages=k_pages, v_pages=v_pages, kv_lens=kv_lens, block_tables=block_tables)
    options = dict(sm_scale=1.0, **IMPLS["pallas-gpu"])  # a change may override them
    for key, value in change.items():
        if key in args:
            args[key] = value(batch)
        else:
            options[key] = value
    with pytest.raises(ValueError, match=message):
        paged_attention(*args.values(), **options)
