"""ragged_paged_attention against a plain dense reference, with K/V scattered over randomly permuted pages.

Every batch of one layout has the same shapes (T, S, pages per sequence, pool size), so the jitted function
compiles once per layout and the cases only change the int32 metadata and the data.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import ragged_paged_attention_dense_reference

from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.xla_ragged_attention import platform_tuning, xla_ragged_attention


def kernel(backend: str) -> dict:
    """Arguments that run the Pallas kernel of `backend`: natively on that backend, else in Pallas' generic
    interpreter."""
    return dict(impl="pallas", backend=backend, interpret=jax.default_backend() != backend)


# Every implementation of the public functions: the XLA implementation and the Pallas TPU and GPU kernels.
IMPLS = {"xla": dict(impl="xla"), "pallas-tpu": kernel("tpu"), "pallas-gpu": kernel("gpu")}


def with_impls(cases: list, tpu_few: list) -> list:
    """(case, impl) pairs: every case with the XLA implementation and the GPU kernel; with the TPU kernel every case
    where it runs natively, only `tpu_few` where it is interpreted (seconds a call: a few edge cases suffice)."""
    tpu_cases = tpu_few if IMPLS["pallas-tpu"]["interpret"] else cases
    return [(case, impl) for case in cases for impl in IMPLS if impl != "pallas-tpu" or case in tpu_cases]


# Given a pool whose head_dim is not a multiple of 128, the TPU kernels pad it (and warn: a copy per call). The sweeps
# here do that on purpose; `test_padded_pool_gives_the_same_result` covers the padded layout the engine allocates.
pytestmark = pytest.mark.filterwarnings("ignore:the TPU kernels need the KV pool's head_dim padded")

NUM_TOKENS = 128  # T: query rows per batch, padding included
NUM_SEQ_ROWS = 8  # S: sequence rows per batch, padding included
MAX_KV = 128  # the longest sequence a block table can hold
SPARE_PAGES = 4  # pages no sequence uses: they must never be read


@dataclasses.dataclass(frozen=True)
class Layout:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: type

    def __str__(self):
        return f"h{self.num_heads}kv{self.num_kv_heads}d{self.head_dim}p{self.page_size}-{jnp.dtype(self.dtype).name}"

    @property
    def atol(self) -> float:
        return 1e-5 if self.dtype == jnp.float32 else 2e-2


# Queries per kv head 1, 3, 4 and 8; head_dim 64 and 128; page sizes 8 and 16; float32 and bfloat16.
LAYOUTS = [
    Layout(3, 3, 64, 8, jnp.float32),
    Layout(6, 2, 64, 16, jnp.float32),
    Layout(4, 1, 128, 16, jnp.float32),
    Layout(8, 1, 64, 8, jnp.float32),
    Layout(6, 2, 128, 8, jnp.bfloat16),
    Layout(8, 2, 64, 16, jnp.bfloat16),
]
GQA = LAYOUTS[1]

# Each case is a function of the page size giving the (q_len, kv_len) of the live sequences.
CASES = {
    "empty-sequence": lambda p: [(0, 0)],
    "decode-kv1": lambda p: [(1, 1)],
    "decode-kv-page-minus-1": lambda p: [(1, p - 1)],
    "decode-kv-page": lambda p: [(1, p)],
    "decode-kv-page-plus-1": lambda p: [(1, p + 1)],
    "decode-kv100": lambda p: [(1, 100)],
    "chunk-mid-sequence": lambda p: [(5, 20)],
    "chunk-mid-sequence-long": lambda p: [(40, 100)],
    "chunk-across-page-boundary": lambda p: [(p + 1, 2 * p + 3)],
    "prompt-page-minus-1": lambda p: [(p - 1, p - 1)],
    "prompt-page": lambda p: [(p, p)],
    "prompt-page-plus-1": lambda p: [(p + 1, p + 1)],
    "prompt-100": lambda p: [(100, 100)],
    "mixed": lambda p: [(1, 1), (0, 0), (5, 20), (1, p - 1), (p + 1, p + 1), (1, 100), (40, 100)],
}


@dataclasses.dataclass
class Batch:
    q: jax.Array  # [T, num_heads, head_dim]
    k_pages: jax.Array  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array  # [num_pages, page_size, num_kv_heads, head_dim]
    kv_lens: jax.Array  # [S] int32
    block_tables: jax.Array  # [S, pages_per_seq] int32
    cu_q_lens: jax.Array  # [S + 1] int32
    num_seqs: jax.Array  # [] int32

    @property
    def args(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


def make_batch(
    layout: Layout, seqs: list[tuple[int, int]], *, seed: int = 0, share_pages: int = 0, poison: bool = False
) -> Batch:
    """seqs: (q_len, kv_len) of the live sequences, padded to NUM_SEQ_ROWS rows and NUM_TOKENS query rows.

    Pages are handed out from a random permutation of 1..num_pages-1 (page 0 is the null page). With share_pages,
    sequence 1 uses sequence 0's first pages (prefix sharing). With poison, every page slot that holds no live
    position -- the null page, spare pages, stale slots of partly filled pages -- and every padding query row is
    NaN.
    """
    rng = np.random.default_rng(seed)
    p = layout.page_size
    pages_per_seq = MAX_KV // p
    num_pages = 1 + NUM_SEQ_ROWS * pages_per_seq + SPARE_PAGES
    free = list(rng.permutation(np.arange(1, num_pages)))
    kv_lens = np.zeros(NUM_SEQ_ROWS, np.int32)
    block_tables = np.zeros((NUM_SEQ_ROWS, pages_per_seq), np.int32)
    cu_q_lens = np.zeros(NUM_SEQ_ROWS + 1, np.int32)
    holds_live_position = np.zeros((num_pages, p), bool)
    for s, (q_len, kv_len) in enumerate(seqs):
        assert q_len <= kv_len <= MAX_KV
        for i in range(math.ceil(kv_len / p)):
            block_tables[s, i] = block_tables[0, i] if s == 1 and i < share_pages else free.pop()
        for pos in range(kv_len):
            holds_live_position[block_tables[s, pos // p], pos % p] = True
        kv_lens[s] = kv_len
        cu_q_lens[s + 1] = cu_q_lens[s] + q_len
    cu_q_lens[len(seqs) + 1 :] = cu_q_lens[len(seqs)]
    num_rows = int(cu_q_lens[-1])
    assert num_rows <= NUM_TOKENS

    shape = (num_pages, p, layout.num_kv_heads, layout.head_dim)
    k_pages, v_pages = rng.standard_normal(shape), rng.standard_normal(shape)
    q = rng.standard_normal((NUM_TOKENS, layout.num_heads, layout.head_dim))
    if poison:
        k_pages[~holds_live_position] = np.nan
        v_pages[~holds_live_position] = np.nan
        q[num_rows:] = np.nan
    return Batch(
        q=jnp.asarray(q, layout.dtype),
        k_pages=jnp.asarray(k_pages, layout.dtype),
        v_pages=jnp.asarray(v_pages, layout.dtype),
        kv_lens=jnp.asarray(kv_lens),
        block_tables=jnp.asarray(block_tables),
        cu_q_lens=jnp.asarray(cu_q_lens),
        num_seqs=jnp.int32(len(seqs)),
    )


def assert_matches_reference(layout: Layout, batch: Batch, out: jax.Array, **kwargs) -> None:
    expected = ragged_paged_attention_dense_reference(*batch.args, **kwargs)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    out, expected = np.asarray(out, np.float32), np.asarray(expected, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, atol=layout.atol, rtol=0 if layout.dtype == jnp.float32 else 2e-2)


def sm_scale(layout: Layout) -> float:
    return 1.0 / math.sqrt(layout.head_dim)


def test_reference_tiny_case_by_hand():
    # One sequence, a 2-token prompt; 1 head, head_dim 2, page_size 2; its one page is page 1 (page 0 is null).
    #   q0 = q1 = [1, 0];  k0 = [0, 0], k1 = [ln 3, 0];  v0 = [4, 0], v1 = [0, 8];  sm_scale = 1.
    # Row 0 (position 0) sees k0 only:             out0 = v0 = [4, 0].
    # Row 1 (position 1): logits [0, ln 3], softmax [1/4, 3/4]: out1 = v0/4 + 3 v1/4 = [1, 6].
    # With sliding_window=1, row 1 sees only k1:    out1 = v1 = [0, 8].
    q = jnp.array([[[1.0, 0.0]], [[1.0, 0.0]], [[5.0, 5.0]]])  # row 2 is padding
    k_pages = jnp.array([[[[9.0, 9.0]], [[9.0, 9.0]]], [[[0.0, 0.0]], [[math.log(3.0), 0.0]]]])
    v_pages = jnp.array([[[[9.0, 9.0]], [[9.0, 9.0]]], [[[4.0, 0.0]], [[0.0, 8.0]]]])
    metadata = (jnp.array([2], jnp.int32), jnp.array([[1]], jnp.int32), jnp.array([0, 2], jnp.int32), jnp.int32(1))
    for attention in (ragged_paged_attention_dense_reference, ragged_paged_attention):
        out = attention(q, k_pages, v_pages, *metadata, sm_scale=1.0)
        np.testing.assert_allclose(np.asarray(out)[:, 0], [[4.0, 0.0], [1.0, 6.0], [0.0, 0.0]], atol=1e-6)
        out = attention(q, k_pages, v_pages, *metadata, sm_scale=1.0, sliding_window=1)
        np.testing.assert_allclose(np.asarray(out)[:, 0], [[4.0, 0.0], [0.0, 8.0], [0.0, 0.0]], atol=1e-6)


def test_reference_soft_cap_by_hand():
    # logits [0, ln 3] with soft_cap 1: tanh(0) = 0 and tanh(ln 3) = (3 - 1/3) / (3 + 1/3) = 0.8,
    # so the weights are [1, e^0.8] / (1 + e^0.8), and with v0 = 0, v1 = 1 the output is e^0.8 / (1 + e^0.8).
    q = jnp.array([[[1.0]]])
    k_pages = jnp.array([[[[0.0]], [[math.log(3.0)]]]])
    v_pages = jnp.array([[[[0.0]], [[1.0]]]])
    metadata = (jnp.array([2], jnp.int32), jnp.array([[0]], jnp.int32), jnp.array([0, 1], jnp.int32), jnp.int32(1))
    out = ragged_paged_attention_dense_reference(q, k_pages, v_pages, *metadata, sm_scale=1.0, soft_cap=1.0)
    np.testing.assert_allclose(float(out[0, 0, 0]), math.exp(0.8) / (1 + math.exp(0.8)), rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_matches_dense_reference(impl, layout, case):
    batch = make_batch(layout, CASES[case](layout.page_size))
    out = ragged_paged_attention(*batch.args, sm_scale=sm_scale(layout), **IMPLS[impl])
    assert_matches_reference(layout, batch, out, sm_scale=sm_scale(layout))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("sliding_window", "soft_cap"), [(5, None), (None, 1.5), (20, 2.0)])
def test_sliding_window_and_soft_cap(impl, sliding_window, soft_cap):
    batch = make_batch(GQA, CASES["mixed"](GQA.page_size))
    kwargs = dict(sm_scale=sm_scale(GQA), sliding_window=sliding_window, soft_cap=soft_cap)
    assert_matches_reference(GQA, batch, ragged_paged_attention(*batch.args, **kwargs, **IMPLS[impl]), **kwargs)


@pytest.mark.parametrize(
    ("layout", "all_pairs", "options"),
    [
        (LAYOUTS[5], True, dict(sliding_window=20, soft_cap=2.0)),  # 8 heads: pair products (see `attend`)
        (LAYOUTS[5], False, dict(sliding_window=None, soft_cap=None)),
        (LAYOUTS[5], False, dict(sliding_window=20, soft_cap=2.0)),
    ],
    ids=str,
)
def test_small_tiles_match_dense_reference(layout, all_pairs, options):
    # Query tiles of 8 rows and kv tiles of 16 keys: chunks span several query tiles and sequences several kv tiles,
    # so the online softmax and the blending of partial tiles into the output are exercised, with both product forms.
    batch = make_batch(layout, CASES["mixed"](layout.page_size), seed=1)
    out = xla_ragged_attention(*batch.args, sm_scale=0.3, q_tile=8, kv_tile=16, all_pairs=all_pairs, **options)
    assert_matches_reference(layout, batch, out, sm_scale=0.3, **options)


@pytest.mark.parametrize("layout", [GQA, LAYOUTS[4], LAYOUTS[5]], ids=str)
@pytest.mark.parametrize("max_q_len", [None, 1])
def test_the_accelerators_tuning_matches_dense_reference(layout, max_q_len):
    # The XLA path as a GPU or TPU runs it (platform_tuning): every sequence of a step at once, products per kv head,
    # tiles in the query's dtype (bfloat16 products for the bfloat16 layouts); stale slots hold NaN.
    tuning = platform_tuning("gpu")
    assert tuning["tiles_in_query_dtype"] and platform_tuning("cpu") == {}
    seqs = CASES["mixed"](layout.page_size) if max_q_len is None else decode_seqs(layout.page_size)
    batch = make_batch(layout, seqs, seed=6, poison=True)
    options = dict(sm_scale=sm_scale(layout), sliding_window=20, soft_cap=2.0)
    out = xla_ragged_attention(*batch.args, **options, **tuning, max_q_len=max_q_len)
    assert_matches_reference(layout, batch, out, **options)


def decode_seqs(page_size: int) -> list[tuple[int, int]]:
    """(q_len, kv_len) of a decode batch: one query row per sequence, a sequence without rows, many kv lengths."""
    return [(1, 1), (0, 0), (1, page_size - 1), (1, page_size), (1, page_size + 1), (1, 100), (1, MAX_KV)]


@pytest.mark.parametrize(
    ("layout", "tuning", "options"),
    [
        (GQA, dict(), dict()),
        (LAYOUTS[4], dict(kv_tile=16), dict(sliding_window=20, soft_cap=2.0)),
        (LAYOUTS[5], dict(kv_tile=16, all_pairs=False), dict()),
    ],
    ids=["gqa-float32", "bfloat16-small-kv-tiles-window-softcap", "bfloat16-per-kv-head"],
)
def test_decode_only_gives_the_same_result(layout, tuning, options):
    # NaN in every slot that holds no live position and in the padding query rows.
    batch = make_batch(layout, decode_seqs(layout.page_size), seed=4, poison=True)
    kwargs = dict(sm_scale=sm_scale(layout), **options)
    general = xla_ragged_attention(*batch.args, **kwargs, **tuning)
    decode = xla_ragged_attention(*batch.args, **kwargs, **tuning, max_q_len=1)
    np.testing.assert_array_equal(np.asarray(decode, np.float32), np.asarray(general, np.float32))
    assert_matches_reference(layout, batch, decode, **kwargs)


def while_loops(function, *args) -> int:
    """The number of while loops in the program jax lowers `function` to for these arguments."""
    return jax.jit(function).lower(*args).as_text().count("stablehlo.while")


def test_decode_only_compiles_no_prefill_loop():
    # A decode step compiles only what it runs: the loop over prefill rows (over sequences, their query tiles and
    # each tile's kv tiles) is not in its program at all.
    batch = make_batch(GQA, decode_seqs(GQA.page_size))
    general = while_loops(functools.partial(xla_ragged_attention, sm_scale=0.2), *batch.args)
    decode = while_loops(functools.partial(xla_ragged_attention, sm_scale=0.2, max_q_len=1), *batch.args)
    assert 0 < decode < general
    verify = while_loops(functools.partial(xla_ragged_attention, sm_scale=0.2, max_q_len=4), *batch.args)
    assert verify == decode


def few_rows_seqs(page_size: int) -> list[tuple[int, int]]:
    """(q_len, kv_len) of a batch whose sequences have at most 4 query rows (verifying speculative tokens)."""
    return [(4, 50), (1, 1), (0, 0), (3, 3), (4, 4), (2, page_size + 1), (4, page_size), (4, MAX_KV)]


@pytest.mark.parametrize(
    ("layout", "tuning", "options"),
    [
        (GQA, dict(), dict()),
        (LAYOUTS[4], dict(kv_tile=16), dict(sliding_window=20, soft_cap=2.0)),
        (LAYOUTS[5], dict(kv_tile=16, all_pairs=False), dict()),
        (LAYOUTS[0], dict(kv_tile=8), dict(sliding_window=3)),
    ],
    ids=["gqa-float32", "bfloat16-small-kv-tiles-window-softcap", "bfloat16-per-kv-head", "mha-window-3"],
)
def test_a_few_rows_per_sequence_all_at_once_give_the_same_result(layout, tuning, options):
    # max_q_len=4: every sequence's rows in the batched last-rows path, no prefill loop; NaN in every slot that
    # holds no live position and in the padding query rows.
    batch = make_batch(layout, few_rows_seqs(layout.page_size), seed=5, poison=True)
    kwargs = dict(sm_scale=sm_scale(layout), **options)
    general = xla_ragged_attention(*batch.args, **kwargs, **tuning)
    few_rows = xla_ragged_attention(*batch.args, **kwargs, **tuning, max_q_len=4)
    np.testing.assert_allclose(np.asarray(few_rows, np.float32), np.asarray(general, np.float32), atol=layout.atol)
    assert_matches_reference(layout, batch, few_rows, **kwargs)


@pytest.mark.parametrize("impl", IMPLS)
def test_shared_prefix_pages(impl):
    p = GQA.page_size
    batch = make_batch(GQA, [(1, 3 * p + 2), (5, 2 * p + 7)], share_pages=2)
    tables = np.asarray(batch.block_tables)
    assert (tables[0, :2] == tables[1, :2]).all() and tables[0, 2] != tables[1, 2]
    assert_matches_reference(GQA, batch, ragged_paged_attention(*batch.args, sm_scale=0.2, **IMPLS[impl]), sm_scale=0.2)


@pytest.mark.parametrize("impl", IMPLS)
def test_stacked_pool_with_a_layer_index_reads_that_layer(impl):
    seqs = CASES["mixed"](GQA.page_size)
    layers = [make_batch(GQA, seqs, seed=seed) for seed in range(3)]
    batch = layers[0]
    k_pool = jnp.stack([b.k_pages for b in layers])  # [3, num_pages, page_size, kv_heads, head_dim]
    v_pool = jnp.stack([b.v_pages for b in layers])
    metadata = (batch.kv_lens, batch.block_tables, batch.cu_q_lens, batch.num_seqs)
    for layer, per_layer in enumerate(layers):
        expected = ragged_paged_attention(
            batch.q, per_layer.k_pages, per_layer.v_pages, *metadata, sm_scale=0.2, **IMPLS[impl]
        )
        out = ragged_paged_attention(
            batch.q, k_pool, v_pool, *metadata, sm_scale=0.2, layer=jnp.int32(layer), **IMPLS[impl]
        )
        np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    with pytest.raises(ValueError, match="with layer, k_pages and v_pages must be"):
        ragged_paged_attention(
            batch.q, batch.k_pages, batch.v_pages, *metadata, sm_scale=0.2, layer=jnp.int32(0), **IMPLS[impl]
        )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", [GQA, LAYOUTS[4]], ids=str)
def test_garbage_outside_the_sequences_is_never_read(impl, layout):
    seqs = CASES["mixed"](layout.page_size)
    clean = ragged_paged_attention(*make_batch(layout, seqs).args, sm_scale=0.2, **IMPLS[impl])
    poisoned = make_batch(layout, seqs, poison=True)
    assert np.isnan(np.asarray(poisoned.k_pages, np.float32)).any()
    out = ragged_paged_attention(*poisoned.args, sm_scale=0.2, **IMPLS[impl])
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(clean, np.float32))


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_rows_are_zero(impl):
    seqs = CASES["mixed"](GQA.page_size)
    batch = make_batch(GQA, seqs)
    out = np.asarray(ragged_paged_attention(*batch.args, sm_scale=0.2, **IMPLS[impl]))
    num_rows = sum(q_len for q_len, _ in seqs)
    assert (out[num_rows:] == 0).all()
    assert (out[:num_rows] != 0).any(axis=(1, 2)).all()
    # The same batch with only its first two sequences live: the rows of the others are padding now.
    out = np.asarray(
        ragged_paged_attention(*dataclasses.replace(batch, num_seqs=jnp.int32(2)).args, sm_scale=0.2, **IMPLS[impl])
    )
    assert (out[1:] == 0).all() and (out[0] != 0).all()  # sequence 0 has one row; sequence 1 none
    out = ragged_paged_attention(*dataclasses.replace(batch, num_seqs=jnp.int32(0)).args, sm_scale=0.2, **IMPLS[impl])
    assert (np.asarray(out) == 0).all()


def test_metadata_is_traced_not_compiled_in():
    kwargs = dict(sm_scale=0.2)
    ragged_paged_attention(*make_batch(GQA, CASES["mixed"](GQA.page_size)).args, **kwargs)
    compiled = ragged_paged_attention._cache_size()
    for case in ("decode-kv100", "prompt-100", "empty-sequence"):
        ragged_paged_attention(*make_batch(GQA, CASES[case](GQA.page_size)).args, **kwargs)
    assert ragged_paged_attention._cache_size() == compiled


BAD_INPUTS = {
    "q-ndim": (lambda b: dict(q=b.q[0]), "q must be"),
    "q-integer": (lambda b: dict(q=b.q.astype(jnp.int32)), "q must be a floating-point"),
    "k-ndim": (lambda b: dict(k_pages=b.k_pages[0], v_pages=b.v_pages[0]), "k_pages must be"),
    "kv-shapes-differ": (lambda b: dict(v_pages=b.v_pages[:-1]), "same shape"),
    "kv-dtypes-differ": (lambda b: dict(v_pages=b.v_pages.astype(jnp.bfloat16)), "same dtype"),
    "head-dim": (lambda b: dict(q=b.q[..., :-1]), "head_dim"),
    "heads-not-multiple": (lambda b: dict(q=b.q[:, :-1]), "multiple of num_kv_heads"),
    "kv-lens-dtype": (lambda b: dict(kv_lens=b.kv_lens.astype(jnp.float32)), "kv_lens must be int32"),
    "tables-dtype": (lambda b: dict(block_tables=b.block_tables.astype(jnp.int16)), "block_tables must be int32"),
    "cu-dtype": (lambda b: dict(cu_q_lens=b.cu_q_lens.astype(jnp.uint32)), "cu_q_lens must be int32"),
    "num-seqs-shape": (lambda b: dict(num_seqs=jnp.array([2], jnp.int32)), "num_seqs"),
    "num-seqs-dtype": (lambda b: dict(num_seqs=jnp.float32(2)), "num_seqs"),
    "kv-lens-ndim": (lambda b: dict(kv_lens=b.kv_lens[:, None]), "kv_lens must be"),
    "tables-rows": (lambda b: dict(block_tables=b.block_tables[:-1]), "block_tables must be"),
    "cu-length": (lambda b: dict(cu_q_lens=b.cu_q_lens[:-1]), "cu_q_lens must be"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_rejects_bad_inputs(name):
    change, message = BAD_INPUTS[name]
    batch = make_batch(GQA, CASES["mixed"](GQA.page_size))
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention(*dataclasses.replace(batch, **change(batch)).args, sm_scale=0.2)


@pytest.mark.parametrize(("kwargs", "message"), [(dict(soft_cap=0.0), "soft_cap"), (dict(sliding_window=0), "window")])
def test_rejects_bad_options(kwargs, message):
    batch = make_batch(GQA, CASES["mixed"](GQA.page_size))
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention(*batch.args, sm_scale=0.2, **kwargs)
