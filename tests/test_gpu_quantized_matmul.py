"""pallas_kernels.gpu_quantized_matmul in Pallas' interpreter against numpy's product with the weight the codes stand
for (int4, int8, FP8 codes); the engine's GPU path (jaxpage.models.quantized.dense) through it.
tests/test_compile_for.py compiles it for an H200 and reads its registers, spills and tensor-core products."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxpage.config.weight_quantization import WeightQuantization
from jaxpage.models.quantized.dense import gpu_kernel, quantized_matmul
from pallas_kernels.gpu_quantized_matmul import gpu_quantized_matmul, supported, tile_rows

CODES = {  # codes dtype -> (values, the array's dtype)
    "int4": (lambda rng, shape: rng.integers(-8, 8, shape), jnp.int4),
    "int8": (lambda rng, shape: rng.integers(-128, 128, shape), jnp.int8),
    "float8_e4m3fn": (
        lambda rng, shape: rng.standard_normal(shape).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * 64,
        jnp.float8_e4m3fn,
    ),
}


def weight(rng, k: int, n: int, group: int, zeros: bool, dtype: str = "int4"):
    groups = -(-k // group)
    values, _ = CODES[dtype]
    codes = values(rng, (k, n))
    scale = rng.uniform(0.01, 0.1, (groups, n)).astype(np.float32)
    zero = rng.integers(-8, 8, (groups, n)) if zeros else np.zeros((groups, n), np.int64)
    rows = np.arange(k) // group
    return codes, scale, (zero if zeros else None), (codes - zero[rows]) * scale[rows]


def product(x, codes, scale, zero, group: int, dtype: str):
    return gpu_quantized_matmul(
        jnp.asarray(x), jnp.asarray(codes, CODES[dtype][1]), jnp.asarray(scale),
        None if zero is None else jnp.asarray(zero, jnp.int8), group=group, int4=dtype == "int4", interpret=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "k", "n", "group", "zeros", "dtype"),
    [
        (1, 576, 192, 128, True, "int4"),  # SmolLM2's k_proj in GPTQ groups of 128: the last group 64 rows
        (1, 256, 128, 64, False, "int4"),
        (17, 512, 256, 128, True, "int4"),  # rows past one block of 16
        (70, 576, 1536, 128, False, "int4"),  # prefill: blocks of 64 rows, one padded
        (3, 96, 64, 32, True, "int4"),  # tiles of 32
        (5, 512, 192, 128, True, "int8"),  # W8A16 groups with zero points
        (1, 576, 256, 576, False, "float8_e4m3fn"),  # FP8 per output channel: one group of every input
        (40, 256, 128, 128, False, "float8_e4m3fn"),  # FP8 in blocks (per column here: dense gives them per column)
    ],
)
def test_the_kernel_equals_the_product_with_the_dequantized_weight(rows, k, n, group, zeros, dtype):
    rng = np.random.default_rng(rows + k)
    codes, scale, zero, w = weight(rng, k, n, group, zeros, dtype)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    want = x @ w
    got = product(x, codes, scale, zero, group, dtype)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_bfloat16_activations_give_the_bfloat16_product():
    rng = np.random.default_rng(0)
    codes, scale, zero, w = weight(rng, 256, 128, 128, True)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    x16 = jnp.asarray(x, jnp.bfloat16)
    got = product(x16, codes, scale, zero, 128, "int4")
    assert got.dtype == jnp.bfloat16
    want = np.asarray(x16, np.float32) @ w
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_the_tiling_covers_the_shapes_checkpoints_come_in_and_refuses_the_rest():
    assert tile_rows(576, 128) == 64 and tile_rows(4096, 128) == 128 and tile_rows(14336, 128) == 128
    assert tile_rows(100, 32) == 0  # 100 rows in tiles of 4: no tensor-core product
    assert supported(4096, 14336, 128) and supported(576, 192, 128)
    assert not supported(576, 48, 32)  # 48 outputs: no block of 64 columns
    assert gpu_kernel(WeightQuantization("gptq", "int4", (128, 1)), 4096, 4096)
    assert gpu_kernel(WeightQuantization("fp8", "float8_e4m3fn", (128, 128)), 4096, 4096)
    assert gpu_kernel(WeightQuantization("compressed-tensors", "float8_e4m3fn", (0, 1)), 4096, 4096)
    w8a8 = WeightQuantization("compressed-tensors", "int8", (0, 1), activations="int8")
    assert not gpu_kernel(w8a8, 4096, 4096)  # int8 by int8: XLA's integer products


@pytest.mark.parametrize(
    ("scheme", "dtype"),
    [
        (WeightQuantization("gptq", "int4", (128, 1), symmetric=False), "int4"),
        (WeightQuantization("fp8", "float8_e4m3fn", (128, 64)), "float8_e4m3fn"),  # blocks of 128 x 64
    ],
    ids=["int4-groups-zero-points", "fp8-blocks"],
)
def test_the_engines_gpu_path_multiplies_through_the_kernel(monkeypatch, scheme, dtype):
    """quantized_matmul for a GPU, run on this CPU: the kernel in Pallas' interpreter (lax.platform_dependent), codes
    as a CPU holds them (int4 in int8, FP8 in float16), column blocks' scales given per column."""
    from pallas_kernels import gpu_quantized_matmul as module

    calls = []
    kernel = module.gpu_quantized_matmul_or_interpret
    monkeypatch.setattr(
        module, "gpu_quantized_matmul_or_interpret", lambda *a, **kw: calls.append(1) or kernel(*a, **kw)
    )
    rng = np.random.default_rng(1)
    k, n = 576, 192
    rows, cols = scheme.block
    values, _ = CODES[dtype]
    codes = values(rng, (k, n))
    scale = rng.uniform(0.01, 0.1, (-(-k // rows), n // cols)).astype(np.float32)
    full = lambda a: np.repeat(np.repeat(a, rows, 0), cols, 1)[:k, :n]  # noqa: E731
    params = {"qweight": jnp.asarray(codes, jnp.int8 if dtype == "int4" else jnp.float16), "qscale": jnp.asarray(scale)}
    w = codes * full(scale)
    if not scheme.symmetric:
        zero = rng.integers(-8, 8, scale.shape)
        params["qzero"] = jnp.asarray(zero, jnp.int8)
        w = (codes - full(zero)) * full(scale)
    x = rng.standard_normal((2, k)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, p: quantized_matmul(x, p, scheme, "gpu"))(jnp.asarray(x), params))
    assert calls
    np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5 * np.abs(x @ w).max())


def test_a_models_gpu_layers_read_each_layers_codes_from_the_stacked_parameter(monkeypatch):
    """The model compiled for a GPU (run on this CPU, the kernel interpreted) gives each quantized projection's kernel
    every layer's codes and the layer's index (Llama.stacked_codes: XLA:GPU would copy a layer's slice for it), and
    its logits are the CPU path's."""
    import dataclasses

    from jaxpage import aot
    from jaxpage.models.llama import DenseBatch, dense_model, init_params
    from pallas_kernels import gpu_quantized_matmul as module

    layers_given = []
    kernel = module.gpu_quantized_matmul_or_interpret

    def spy(x, codes, scale, zero, layer=None, **kw):
        layers_given.append(codes.ndim == 3 and layer is not None)
        return kernel(x, codes, scale, zero, layer, **kw)

    monkeypatch.setattr(module, kernel.__name__, spy)
    scheme = WeightQuantization("gptq", "int4", (32, 1), symmetric=False)
    config = dataclasses.replace(
        aot.model_shape("default"), hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=32, vocab_size=256, weight_quantization=scheme,
    )  # fmt: skip
    params = init_params(config, jax.random.key(0), jnp.float32, "cpu")
    rng = np.random.default_rng(0)

    def randomized(path, leaf):
        name = path[-1].key
        if name == "qweight":
            return jnp.asarray(rng.integers(-8, 8, leaf.shape), leaf.dtype)
        if name == "qzero":
            return jnp.asarray(rng.integers(-8, 8, leaf.shape), leaf.dtype)
        if name == "qscale":
            return jnp.asarray(rng.uniform(0.01, 0.05, leaf.shape), leaf.dtype)
        return leaf

    params = jax.tree_util.tree_map_with_path(randomized, params)
    tokens = jnp.asarray([[3, 17, 42, 7, 99]], jnp.int32)
    batch = DenseBatch(positions=jnp.arange(5)[None], valid=jnp.ones((1, 5), bool))

    def logits(platform):
        model = dense_model(config, jnp.float32, platform)
        run = lambda m, *args: m.logits(m(*args)[0])  # noqa: E731
        return np.asarray(
            jax.jit(lambda p: model.apply({"params": p}, tokens, batch.positions, batch, method=run))(params)
        )

    want = logits("cpu")
    got = logits("gpu")
    assert layers_given and all(layers_given), layers_given  # 7 projections x 2 layers, each from the stack
    assert len(layers_given) == 14
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
