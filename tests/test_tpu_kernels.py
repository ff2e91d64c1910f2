"""The TPU (Mosaic) kernels beyond the generic-interpreter sweeps of test_ragged_paged_attention/test_paged_attention:

- a few cases in Pallas' TPU interpret mode (about a second a call), which models DMAs, semaphores and memory
  spaces: an out-of-bounds DMA raises there (the generic interpreter silently clamps it), and with race detection
  it reports a read of a buffer a DMA is still writing;
- lowering to Mosaic for a TPU from this machine, which runs every Pallas lowering rule the kernels need;
- the pool layout they need: head_dim padded to a multiple of 128, and both the public functions' view of the pool
  and the TPU layout jaxpage allocates (kv heads side by side, a [rows, 128] block of scales per page);
- both of the above for 8-bit pages (int8, fp8) with their scales, applied in the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from test_paged_attention import assert_close, decode_args, decode_case, expected
from test_quantized_kv_attention import quantized_batch
from test_ragged_paged_attention import (
    CASES,
    GQA,
    IMPLS,
    LAYOUTS,
    assert_matches_reference,
    make_batch,
    sm_scale,
)

from pallas_kernels.impl import pad_head_dim, padded_head_dim, tpu_scale_rows
from pallas_kernels.kv_quantization import SCALE_DTYPE, is_quantized
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.tpu_decode_attention import tpu_decode_attention
from pallas_kernels.tpu_ragged_attention import tpu_ragged_attention

TPU_INTERPRET = dict(impl="pallas", interpret=pltpu.InterpretParams())
DETECT_RACES = dict(impl="pallas", interpret=pltpu.InterpretParams(detect_races=True))
BF16 = LAYOUTS[4]  # 6 heads over 2 kv heads, head_dim 128, page size 8, bfloat16
BF16_PADDED = LAYOUTS[5]  # 8 heads over 2 kv heads, head_dim 64, page size 16, bfloat16
# 8-bit pages in TPU interpret mode: each format with a float32 and a bfloat16 q (the kernels' compute dtype).
QUANTIZED = [(GQA, jnp.int8), (BF16_PADDED, jnp.float8_e4m3fn)]
QUANTIZED_IDS = ["float32-int8", "bfloat16-float8_e4m3fn"]


def padded_pool(batch):
    """The batch with its pool's head_dim padded to a multiple of 128 (the layout jaxpage allocates on TPU)."""
    head_dim = padded_head_dim(batch.k_pages.shape[-1])
    return dataclasses.replace(
        batch, k_pages=pad_head_dim(batch.k_pages, head_dim), v_pages=pad_head_dim(batch.v_pages, head_dim)
    )


def padded_quantized_pool(quantized):
    """A QuantizedBatch's 8-bit pages with head_dim padded with zeros to a multiple of 128 (scales unchanged)."""
    head_dim = padded_head_dim(quantized.k_pages.shape[-1])
    return dataclasses.replace(
        quantized, k_pages=pad_head_dim(quantized.k_pages, head_dim), v_pages=pad_head_dim(quantized.v_pages, head_dim)
    )


@pytest.mark.parametrize(
    ("layout", "options"),
    [(GQA, dict()), (BF16, dict(sliding_window=20, soft_cap=2.0))],
    ids=["gqa-float32", "bfloat16-window-softcap"],
)
def test_ragged_kernel_in_tpu_interpret_mode(layout, options):
    batch = make_batch(layout, CASES["mixed"](layout.page_size), poison=True)
    out = ragged_paged_attention(*padded_pool(batch).args, sm_scale=sm_scale(layout), **options, **TPU_INTERPRET)
    assert_matches_reference(layout, batch, out, sm_scale=sm_scale(layout), **options)


def test_decode_kernel_in_tpu_interpret_mode_has_no_races():
    # Its pipeline runs across programs (a program fetches the next sequence's first kv tile): the race detector
    # checks that no kv tile is read while a DMA still writes it.
    layout = GQA
    batch = make_batch(layout, decode_case(layout.page_size), poison=True)
    options = dict(sm_scale=sm_scale(layout), sliding_window=40)
    got = paged_attention(*decode_args(padded_pool(batch)), **options, **DETECT_RACES)
    assert not tpu_interpreter.races.races_found
    assert_close(layout, got, expected(batch, **options))


@pytest.mark.parametrize(("layout", "dtype"), QUANTIZED, ids=QUANTIZED_IDS)
def test_quantized_ragged_kernel_in_tpu_interpret_mode_has_no_races(layout, dtype):
    # 8-bit pages and their scales come in by separate DMAs: none of them may be read before it lands. Stale slots
    # hold NaN scales (and NaN fp8 values); the reference reads the dequantized pool.
    quantized = quantized_batch(layout, CASES["mixed"](layout.page_size), dtype, poison=True)
    options = dict(sm_scale=sm_scale(layout), sliding_window=40)
    out = ragged_paged_attention(
        *padded_quantized_pool(quantized).args, **quantized.scales, **options, **DETECT_RACES
    ).block_until_ready()
    assert not tpu_interpreter.races.races_found
    assert_matches_reference(layout, quantized.batch, out, **options)


@pytest.mark.parametrize(("layout", "dtype"), QUANTIZED, ids=QUANTIZED_IDS)
def test_quantized_decode_kernel_in_tpu_interpret_mode_has_no_races(layout, dtype):
    # The decode pipeline runs across programs: the next sequence's first pages and scales are fetched early.
    quantized = quantized_batch(layout, decode_case(layout.page_size), dtype, seed=1, poison=True)
    padded = padded_quantized_pool(quantized)
    q, _, _, kv_lens, tables = decode_args(quantized.batch)
    options = dict(sm_scale=sm_scale(layout), soft_cap=30.0)
    got = paged_attention(
        q, padded.k_pages, padded.v_pages, kv_lens, tables, **quantized.scales, **options, **DETECT_RACES
    ).block_until_ready()
    assert not tpu_interpreter.races.races_found
    assert got.dtype == layout.dtype
    assert_close(layout, got, expected(quantized.batch, **options))


def test_the_race_detector_finds_a_read_during_a_dma():
    # The check above could not fail if the detector saw nothing: here is a read of a buffer a DMA is writing.
    def racy(x_hbm, o_ref, buffer, sem):
        copy = pltpu.make_async_copy(x_hbm, buffer, sem)
        copy.start()
        o_ref[...] = buffer[...]
        copy.wait()

    pl.pallas_call(
        racy,
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
        interpret=pltpu.InterpretParams(detect_races=True),
    )(jnp.ones((8, 128), jnp.float32)).block_until_ready()
    assert tpu_interpreter.races.races_found


def test_tpu_interpret_mode_catches_a_page_id_out_of_the_pool():
    # A block table entry past the pool: TPU interpret mode raises on the DMA (the generic interpreter would clamp
    # it and read some other page). The public functions cannot check traced ids; the engine never makes them.
    batch = padded_pool(make_batch(GQA, [(1, 20)]))
    tables = batch.block_tables.at[0, 1].set(batch.k_pages.shape[0] + 5)
    with pytest.raises(Exception, match="(?i)out.of.bounds|out of range"):
        paged_attention(*decode_args(dataclasses.replace(batch, block_tables=tables)), sm_scale=0.2, **TPU_INTERPRET)


@pytest.mark.parametrize(
    "pool_dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name
)
@pytest.mark.parametrize(("sliding_window", "soft_cap"), [(None, None), (32, 30.0)])
@pytest.mark.parametrize("layout", ["public", "tpu"])
def test_kernels_lower_to_mosaic(pool_dtype, sliding_window, soft_cap, layout):
    # Exporting for a TPU runs the Pallas-to-Mosaic lowering of every operation in the kernels (Mosaic's own
    # compiler passes run on the TPU host, not here). SmolLM2's shapes: 9 heads over 3 kv heads, head_dim 64 padded.
    # 8-bit pages come with a bfloat16 q and add the two scale operands; float pages take q in their dtype.
    seqs, tokens, pages_per_seq = 8, 128, 16
    spec = jax.ShapeDtypeStruct
    quantized = is_quantized(pool_dtype)
    q_dtype = jnp.bfloat16 if quantized else pool_dtype
    pool = spec((100, 16, 3, 128) if layout == "public" else (100, 16, 3 * 128), pool_dtype)
    scale_shape = (100, 16, 3) if layout == "public" else (100, tpu_scale_rows(16, 3), 128)
    scales = spec(scale_shape, SCALE_DTYPE) if quantized else None
    options = dict(sm_scale=0.125, soft_cap=soft_cap, sliding_window=sliding_window, pages_per_kv_tile=8)
    tables, kv_lens = spec((seqs, pages_per_seq), jnp.int32), spec((seqs,), jnp.int32)

    def ragged(q, k, v, kv_lens, tables, cu_q_lens, k_scales, v_scales):
        scales = dict(k_scales=k_scales, v_scales=v_scales)
        return tpu_ragged_attention(
            q, k, v, kv_lens, tables, cu_q_lens, **scales, **options, q_tile=32, interpret=False
        )

    def decode(q, k, v, kv_lens, tables, k_scales, v_scales):
        scales = dict(k_scales=k_scales, v_scales=v_scales)
        return tpu_decode_attention(q, k, v, kv_lens, tables, **scales, **options, interpret=False)

    export = functools.partial(jax.export.export, platforms=["tpu"])
    cu_q_lens = spec((seqs + 1,), jnp.int32)
    for function, args, float_operands in (  # operands: the scalar-prefetch ones, q, the pages (and scales)
        (ragged, (spec((tokens, 9, 128), q_dtype), pool, pool, kv_lens, tables, cu_q_lens, scales, scales), 7),
        (decode, (spec((seqs, 9, 128), q_dtype), pool, pool, kv_lens, tables, scales, scales), 5),
    ):
        module = export(jax.jit(function))(*args).mlir_module()
        [operands] = re.findall(r"custom_call @tpu_custom_call\(([^)]*)\)", module)
        assert len(operands.split(",")) == float_operands + 2 * quantized


@pytest.mark.parametrize("impl", IMPLS)
def test_padded_pool_gives_the_same_result(impl):
    # head_dim 64 in a pool padded to 128: the same output, in q's head_dim, from every implementation.
    batch = make_batch(GQA, CASES["mixed"](GQA.page_size), poison=True)
    padded = padded_pool(batch)
    assert padded.k_pages.shape[-1] == 128
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no copy of a padded pool
        out = ragged_paged_attention(*padded.args, sm_scale=0.2, **IMPLS[impl])
    assert out.shape == batch.q.shape
    assert_matches_reference(GQA, batch, out, sm_scale=0.2)


def test_tpu_kernel_pads_an_unpadded_pool_and_says_so():
    batch = make_batch(GQA, CASES["mixed"](GQA.page_size))
    # The warning comes when the function is traced: an sm_scale no other test uses makes a fresh trace.
    with pytest.warns(UserWarning, match="padded to a multiple of 128"):
        out = ragged_paged_attention(*batch.args, sm_scale=0.31, **IMPLS["pallas-tpu"])
    assert_matches_reference(GQA, batch, out, sm_scale=0.31)


def test_pool_head_dim_must_be_q_s_or_padded():
    batch = make_batch(GQA, CASES["mixed"](GQA.page_size))
    wrong = dataclasses.replace(batch, k_pages=pad_head_dim(batch.k_pages, 96), v_pages=pad_head_dim(batch.v_pages, 96))
    with pytest.raises(ValueError, match=r"must be q's \(64\) or q's padded to a multiple of 128 \(128\)"):
        ragged_paged_attention(*wrong.args, sm_scale=0.2)
