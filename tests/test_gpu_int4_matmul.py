"""pallas_kernels.gpu_int4_matmul in Pallas' interpreter against numpy's product with the weight the codes stand for;
the engine's GPU path (jaxpage.models.quantized.dense) through it. tests/test_compile_for.py compiles it for an H200
and reads its registers, spills and tensor-core products."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpage.config.weight_quantization import WeightQuantization
from jaxpage.models.quantized.dense import gpu_kernel, quantized_matmul
from pallas_kernels.gpu_int4_matmul import gpu_int4_matmul, supported, tile_rows


def weight(rng, k: int, n: int, group: int, zeros: bool):
    groups = -(-k // group)
    codes = rng.integers(-8, 8, (k, n))
    scale = rng.uniform(0.01, 0.1, (groups, n)).astype(np.float32)
    zero = rng.integers(-8, 8, (groups, n)) if zeros else np.zeros((groups, n), np.int64)
    rows = np.arange(k) // group
    return codes, scale, (zero if zeros else None), (codes - zero[rows]) * scale[rows]


@pytest.mark.parametrize(
    ("rows", "k", "n", "group", "zeros"),
    [
        (1, 576, 192, 128, True),  # SmolLM2's k_proj in GPTQ groups of 128: the last group 64 rows
        (1, 256, 128, 64, False),
        (17, 512, 256, 128, True),  # rows past one block of 16
        (70, 576, 1536, 128, False),  # prefill: blocks of 64 rows, one padded
        (3, 96, 64, 32, True),  # tiles of 32
    ],
)
def test_the_kernel_equals_the_product_with_the_dequantized_weight(rows, k, n, group, zeros):
    rng = np.random.default_rng(rows + k)
    codes, scale, zero, w = weight(rng, k, n, group, zeros)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    got = gpu_int4_matmul(
        jnp.asarray(x), jnp.asarray(codes, jnp.int4), jnp.asarray(scale),
        None if zero is None else jnp.asarray(zero, jnp.int8), group=group, interpret=True,
    )  # fmt: skip
    want = x @ w
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_bfloat16_activations_give_the_bfloat16_product():
    rng = np.random.default_rng(0)
    codes, scale, zero, w = weight(rng, 256, 128, 128, True)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    x16 = jnp.asarray(x, jnp.bfloat16)
    got = gpu_int4_matmul(x16, jnp.asarray(codes, jnp.int4), jnp.asarray(scale), jnp.asarray(zero, jnp.int8),
                          group=128, interpret=True)  # fmt: skip
    assert got.dtype == jnp.bfloat16
    want = np.asarray(x16, np.float32) @ w
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_the_tiling_covers_the_shapes_checkpoints_come_in_and_refuses_the_rest():
    assert tile_rows(576, 128) == 64 and tile_rows(4096, 128) == 128 and tile_rows(14336, 128) == 128
    assert tile_rows(100, 32) == 0  # 100 rows in tiles of 4: no tensor-core product
    assert supported(4096, 14336, 128) and supported(576, 192, 128)
    assert not supported(576, 48, 32)  # 48 outputs: no block of 64 columns
    w4 = WeightQuantization("gptq", "int4", (128, 1))
    assert gpu_kernel(w4, 4096, 4096)
    assert not gpu_kernel(WeightQuantization("fp8", "float8_e4m3fn", (128, 128)), 4096, 4096)
    assert not gpu_kernel(WeightQuantization("compressed-tensors", "int4", (128, 64)), 4096, 4096)  # column blocks


def test_the_engines_gpu_path_multiplies_through_the_kernel(monkeypatch):
    """quantized_matmul for a GPU, run on this CPU: the kernel in Pallas' interpreter (lax.platform_dependent), codes
    held in int8 as a CPU holds int4 ones."""
    from pallas_kernels import gpu_int4_matmul as module

    calls = []
    kernel = module.gpu_int4_matmul_or_interpret
    monkeypatch.setattr(module, "gpu_int4_matmul_or_interpret", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    rng = np.random.default_rng(1)
    codes, scale, zero, w = weight(rng, 576, 192, 128, True)
    x = rng.standard_normal((2, 576)).astype(np.float32)
    params = {"qweight": jnp.asarray(codes, jnp.int8), "qscale": jnp.asarray(scale)}
    params["qzero"] = jnp.asarray(zero, jnp.int8)
    scheme = WeightQuantization("gptq", "int4", (128, 1), symmetric=False)
    got = np.asarray(jax.jit(lambda x, p: quantized_matmul(x, p, scheme, "gpu"))(jnp.asarray(x), params))
    assert calls
    np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5 * np.abs(x @ w).max())
