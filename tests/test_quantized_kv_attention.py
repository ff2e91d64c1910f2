"""8-bit KV pages (int8, fp8 e4m3, fp8 e5m2) with per-token, per-KV-head scales: every attention implementation
against the dense reference on the dequantized pool, with NaN-poisoned stale slots (pages and scales), and the
quantization itself.

The dequantized pool is exact in float32 (an 8-bit value times a bfloat16 scale), so an implementation that reads
8-bit pages must match the reference on that pool as closely as one that reads float pages.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention import assert_close, decode_args, decode_case, expected
from test_ragged_paged_attention import (
    CASES,
    GQA,
    IMPLS,
    LAYOUTS,
    Batch,
    assert_matches_reference,
    make_batch,
    sm_scale,
    with_impls,
)

from pallas_kernels.gpu_decode_attention import gpu_decode_attention
from pallas_kernels.gpu_ragged_attention import gpu_ragged_attention
from pallas_kernels.kv_quantization import QUANTIZED_KV_DTYPES, SCALE_DTYPE, dequantize, quantize
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

pytestmark = pytest.mark.filterwarnings("ignore:the TPU kernels need the KV pool's head_dim padded")

FORMATS = {jnp.dtype(d).name: d for d in QUANTIZED_KV_DTYPES}  # int8, float8_e4m3fn, float8_e5m2
BF16 = LAYOUTS[4]  # 6 heads over 2 kv heads, head_dim 128, page size 8, bfloat16


@dataclasses.dataclass
class QuantizedBatch:
    batch: Batch  # its k_pages, v_pages: the dequantized pool (what the reference reads)
    k_pages: jax.Array  # 8-bit
    v_pages: jax.Array
    k_scales: jax.Array  # [num_pages, page_size, num_kv_heads]
    v_scales: jax.Array

    @property
    def args(self) -> tuple:
        b = self.batch
        return (b.q, self.k_pages, self.v_pages, b.kv_lens, b.block_tables, b.cu_q_lens, b.num_seqs)

    @property
    def scales(self) -> dict:
        return dict(k_scales=self.k_scales, v_scales=self.v_scales)


def quantized_batch(layout, seqs, dtype, *, seed=0, poison=False, **kwargs) -> QuantizedBatch:
    """make_batch's batch with its pool quantized to `dtype`. With poison, every slot that holds no live position
    has NaN scales, and NaN values where the format has NaN (fp8; int8 has none); the reference's pool is NaN
    there too."""
    batch = make_batch(layout, seqs, seed=seed, poison=poison, **kwargs)
    clean = make_batch(layout, seqs, seed=seed, **kwargs) if poison else batch
    (k, k_scales), (v, v_scales) = quantize(clean.k_pages, dtype), quantize(clean.v_pages, dtype)
    if poison:
        slots = np.isnan(np.asarray(batch.k_pages, np.float32)).all(axis=(-2, -1))  # [num_pages, page_size]
        k_scales, v_scales = (jnp.where(slots[..., None], jnp.nan, s) for s in (k_scales, v_scales))
        if jnp.issubdtype(dtype, jnp.floating):
            k, v = (jnp.where(slots[..., None, None], jnp.nan, x).astype(dtype) for x in (k, v))
    dequantized = dict(k_pages=dequantize(k, k_scales, layout.dtype), v_pages=dequantize(v, v_scales, layout.dtype))
    batch = dataclasses.replace(batch, **dequantized)
    return QuantizedBatch(batch, k, v, k_scales, v_scales)


@pytest.mark.parametrize("dtype", FORMATS)
def test_quantize_round_trip_error_is_within_half_a_step(dtype):
    x = jax.random.normal(jax.random.key(0), (64, 4, 64)) * jnp.logspace(-3, 3, 64)[:, None, None]
    values, scales = quantize(x, FORMATS[dtype])
    assert values.dtype == jnp.dtype(FORMATS[dtype]) and scales.dtype == SCALE_DTYPE and scales.shape == (64, 4)
    error = np.abs(np.asarray(dequantize(values, scales) - x))
    absmax = np.abs(np.asarray(x)).max(-1, keepdims=True)
    # int8: half a step of absmax / 127 (the bfloat16 scale: 1/256 more). fp8: half an ulp of the format, relative
    # to each value (3 mantissa bits for e4m3, 2 for e5m2), plus the smallest normal's step near zero.
    if dtype == "int8":
        bound = absmax / 127 * (0.5 + 2**-8) + 1e-12
    else:
        bits = 3 if dtype == "float8_e4m3fn" else 2
        tiny = float(jnp.finfo(FORMATS[dtype]).smallest_normal) * 2.0**-bits
        bound = (
            np.abs(np.asarray(x)) * 2.0 ** -(bits + 1) * 1.01 + absmax / QUANTIZED_KV_DTYPES[jnp.dtype(dtype)] * tiny
        )
    assert (error <= bound).all(), float((error - bound).max())


@pytest.mark.parametrize("dtype", FORMATS)
def test_quantize_zeros_and_extremes(dtype):
    x = jnp.zeros((2, 8)).at[1].set(jnp.array([1e30, -1e30, 3e29, 0, 0, 0, 0, 1.0]))
    values, scales = quantize(x, FORMATS[dtype])
    assert float(scales[0]) == 0 and (np.asarray(values[0], np.float32) == 0).all()
    back = np.asarray(dequantize(values, scales))
    assert np.isfinite(back).all()
    np.testing.assert_allclose(back[1, :2], [1e30, -1e30], rtol=2e-2)


# In the interpreter the TPU kernel runs each format once, on either layout.
TPU_FEW = [("int8", GQA), ("float8_e4m3fn", BF16), ("float8_e5m2", GQA)]


@pytest.mark.parametrize(
    ("dtype", "layout", "impl"),
    [(*case, impl) for case, impl in with_impls([(d, lay) for lay in (GQA, BF16) for d in FORMATS], TPU_FEW)],
    ids=str,
)
def test_ragged_matches_reference_on_the_dequantized_pool(impl, dtype, layout):
    batch = quantized_batch(layout, CASES["mixed"](layout.page_size), FORMATS[dtype], poison=True)
    options = dict(sm_scale=sm_scale(layout), sliding_window=40 if layout is BF16 else None)
    out = ragged_paged_attention(*batch.args, **batch.scales, **options, **IMPLS[impl])
    assert_matches_reference(layout, batch.batch, out, **options)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", FORMATS)
def test_decode_matches_reference_on_the_dequantized_pool(impl, dtype):
    layout = GQA
    batch = quantized_batch(layout, decode_case(layout.page_size), FORMATS[dtype], seed=1, poison=True)
    q, _, _, kv_lens, tables = decode_args(batch.batch)
    options = dict(sm_scale=sm_scale(layout), soft_cap=30.0)
    got = paged_attention(q, batch.k_pages, batch.v_pages, kv_lens, tables, **batch.scales, **options, **IMPLS[impl])
    assert got.dtype == layout.dtype
    assert_close(layout, got, expected(batch.batch, **options))


@pytest.mark.parametrize("impl", IMPLS)
def test_stacked_quantized_pool_with_a_layer_index_reads_that_layer(impl):
    seqs = CASES["mixed"](GQA.page_size)
    layers = [quantized_batch(GQA, seqs, jnp.int8, seed=seed) for seed in range(3)]
    names = ("k_pages", "v_pages", "k_scales", "v_scales")
    k, v, k_scales, v_scales = (jnp.stack([getattr(b, name) for b in layers]) for name in names)
    b = layers[0].batch
    metadata = (b.kv_lens, b.block_tables, b.cu_q_lens, b.num_seqs)
    scales = dict(k_scales=k_scales, v_scales=v_scales)
    out = ragged_paged_attention(b.q, k, v, *metadata, **scales, layer=jnp.int32(1), sm_scale=0.2, **IMPLS[impl])
    layer_1 = dataclasses.replace(b, k_pages=layers[1].batch.k_pages, v_pages=layers[1].batch.v_pages)
    assert_matches_reference(GQA, layer_1, out, sm_scale=0.2)


@pytest.mark.parametrize("dtype", FORMATS)
def test_8_bit_pages_stay_close_to_float_pages(dtype):
    # What quantization costs: attention over the quantized pool against the same pool in float32.
    layout = GQA
    seqs = CASES["mixed"](layout.page_size)
    exact = ragged_paged_attention(*make_batch(layout, seqs).args, sm_scale=sm_scale(layout))
    batch = quantized_batch(layout, seqs, FORMATS[dtype])
    out = ragged_paged_attention(*batch.args, **batch.scales, sm_scale=sm_scale(layout))
    error = float(jnp.sqrt(jnp.mean((out - exact) ** 2) / jnp.mean(exact**2)))
    assert error < {"int8": 0.01, "float8_e4m3fn": 0.05, "float8_e5m2": 0.1}[dtype], error


BAD_SCALES = {
    "int8-without-scales": (lambda b: dict(k_scales=None, v_scales=None), "need k_scales and v_scales"),
    "one-scale-only": (lambda b: dict(v_scales=None), "with k_scales"),
    "float-pages-with-scales": (lambda b: dict(k_pages=b.batch.k_pages, v_pages=b.batch.v_pages), "other pages none"),
    "scales-shape": (lambda b: dict(k_scales=b.k_scales[:, :-1]), "k_scales must be"),
    "scales-dtype": (lambda b: dict(v_scales=b.v_scales.astype(jnp.int32)), "v_scales must be a floating-point"),
    "integer-pages": (
        lambda b: dict(k_pages=b.k_pages.astype(jnp.int16), v_pages=b.v_pages.astype(jnp.int16)),
        "8-bit",
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", BAD_SCALES)
def test_rejects_bad_scales(name):
    change, message = BAD_SCALES[name]
    batch = quantized_batch(GQA, CASES["mixed"](GQA.page_size), jnp.int8)
    args = dict(
        zip(("q", "k_pages", "v_pages", "kv_lens", "block_tables", "cu_q_lens", "num_seqs"), batch.args, strict=True)
    )
    kwargs = {**args, **batch.scales, **change(batch)}
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention(**kwargs, sm_scale=0.2)
    q, k, v, kv_lens, tables = (kwargs[n] for n in ("q", "k_pages", "v_pages", "kv_lens", "block_tables"))
    scales = dict(k_scales=kwargs["k_scales"], v_scales=kwargs["v_scales"])
    with pytest.raises(ValueError, match=message):
        paged_attention(q[:8], k, v, kv_lens, tables, **scales, sm_scale=0.2, impl="xla")


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize(("num_splits", "pages_per_kv_tile"), [(1, 1), (2, 2), (4, 1), (8, 1)])
def test_gpu_decode_kernel_splits_and_kv_tiles(num_splits, pages_per_kv_tile, dtype):
    # The GPU decode kernel's split-K over 8-bit pages (as test_paged_attention's float sweep): page size 8, 16
    # pages a table, so 8 splits leave 2 pages each and most splits of short sequences are empty. Stale slots'
    # scales (and fp8 values) are NaN.
    layout = LAYOUTS[0]
    batch = quantized_batch(layout, decode_case(layout.page_size), FORMATS[dtype], seed=3, poison=True)
    q, _, _, kv_lens, tables = decode_args(batch.batch)
    got = gpu_decode_attention(
        *(q, batch.k_pages, batch.v_pages, kv_lens, tables),
        **batch.scales,
        sm_scale=sm_scale(layout),
        soft_cap=None,
        sliding_window=None,
        num_splits=num_splits,
        pages_per_kv_tile=pages_per_kv_tile,
        interpret=IMPLS["pallas-gpu"]["interpret"],
    )
    assert_close(layout, got, expected(batch.batch, sm_scale=sm_scale(layout)))


TRITON_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")  # a Triton kernel's custom call (by jaxlib)


@pytest.mark.parametrize("dtype", ["bfloat16", *FORMATS])
def test_gpu_kernels_lower_to_triton(dtype):
    # Exporting for an NVIDIA GPU runs the Pallas-to-Triton lowering of every operation in the kernels, the casts of
    # 8-bit values included (without a GPU, for compute capability 9.0). 8-bit pages add the two scale operands;
    # float pools compile without them. SmolLM2's shapes: 9 heads over 3 kv heads, head_dim 64, page size 16.
    spec = jax.ShapeDtypeStruct
    seqs, quantized = 8, dtype != "bfloat16"
    pool = spec((100, 16, 3, 64), jnp.dtype(dtype))
    scales = spec((100, 16, 3), SCALE_DTYPE) if quantized else None
    kv_lens, tables = spec((seqs,), jnp.int32), spec((seqs, 16), jnp.int32)
    options = dict(sm_scale=0.125, soft_cap=30.0, sliding_window=32, pages_per_kv_tile=8, interpret=False)

    def ragged(q, k, v, kv_lens, tables, cu_q_lens, k_scales, v_scales):
        scales = dict(k_scales=k_scales, v_scales=v_scales)
        return gpu_ragged_attention(q, k, v, kv_lens, tables, cu_q_lens, **scales, q_rows=16, **options)

    def decode(q, k, v, kv_lens, tables, k_scales, v_scales):
        scales = dict(k_scales=k_scales, v_scales=v_scales)
        return gpu_decode_attention(q, k, v, kv_lens, tables, **scales, num_splits=2, **options)

    checks = [jax.export.DisabledSafetyCheck.custom_call(target) for target in TRITON_CALLS]
    export = functools.partial(jax.export.export, platforms=["cuda"], disabled_checks=checks)
    cu_q_lens = spec((seqs + 1,), jnp.int32)
    for function, args, float_operands in (
        (ragged, (spec((128, 9, 64), jnp.bfloat16), pool, pool, kv_lens, tables, cu_q_lens, scales, scales), 7),
        (decode, (spec((seqs, 9, 64), jnp.bfloat16), pool, pool, kv_lens, tables, scales, scales), 5),
    ):
        try:
            module = export(jax.jit(function))(*args).mlir_module()
        except RuntimeError as e:  # newer jaxlibs compile the Triton module while lowering: a GPU plugin's job
            if "Triton compilation handler" not in str(e):
                raise
            pytest.skip(f"lowered to Triton, not compiled: {e}")
        targets = "|".join(re.escape(target) for target in TRITON_CALLS)
        [operands] = re.findall(rf"custom_call @(?:{targets})\(([^)]*)\)", module)
        assert len(operands.split(",")) == float_operands + 2 * quantized


def _dot_operand_dtypes(jaxpr) -> set[tuple[str, str]]:
    """The (lhs, rhs) dtypes of every dot_general in `jaxpr` and the jaxprs in it (a Pallas kernel's, its loops')."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.add(tuple(jnp.dtype(x.aval.dtype).name for x in eqn.invars))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr, or a Jaxpr
                if hasattr(inner, "eqns"):
                    found |= _dot_operand_dtypes(inner)
    return found


@pytest.mark.parametrize(("q_dtype", "pool_dtype"), [("bfloat16", "bfloat16"), ("bfloat16", "int8"),
                                                    ("bfloat16", "float8_e4m3fn"), ("float32", "float32"),
                                                    ("float32", "int8")])  # fmt: skip
def test_gpu_kernels_multiply_in_the_querys_dtype(q_dtype, pool_dtype):
    # Both products of both GPU kernels take the query's dtype: bfloat16 on the tensor cores (8-bit pages widened
    # to it, their scales applied to the logits and probabilities), float32 for a float32 model -- never a 16-bit
    # or 8-bit tile widened to float32 (scalar FMAs: the first H200 run's 1% of bandwidth).
    spec = jax.ShapeDtypeStruct
    seqs, quantized = 8, jnp.dtype(pool_dtype).itemsize == 1
    pool = spec((100, 16, 2, 128), jnp.dtype(pool_dtype))
    scales = (
        dict(k_scales=spec((100, 16, 2), SCALE_DTYPE), v_scales=spec((100, 16, 2), SCALE_DTYPE)) if quantized else {}
    )
    kv_lens, tables, cu_q_lens = spec((seqs,), jnp.int32), spec((seqs, 16), jnp.int32), spec((seqs + 1,), jnp.int32)
    options = dict(sm_scale=0.125, soft_cap=None, sliding_window=None, pages_per_kv_tile=8, interpret=False)
    decode = functools.partial(gpu_decode_attention, **scales, num_splits=2, **options)
    ragged = functools.partial(gpu_ragged_attention, **scales, **options)
    for kernel, args in (
        (decode, (spec((seqs, 8, 128), jnp.dtype(q_dtype)), pool, pool, kv_lens, tables)),
        (ragged, (spec((64, 8, 128), jnp.dtype(q_dtype)), pool, pool, kv_lens, tables, cu_q_lens)),
    ):
        assert _dot_operand_dtypes(jax.make_jaxpr(kernel)(*args).jaxpr) == {(q_dtype, q_dtype)}
