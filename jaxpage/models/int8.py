"""int8 weights: one scale per output channel, applied inside the jitted step, by the dot that reads them.

A quantized projection keeps `kernel` as int8 and `scale` (float32, one per output feature) beside it:
w ~ kernel * scale, with scale = max |w| over the contracted (input) axes / 127. The matmul reads the int8 kernel
and scales the output columns: x @ (kernel * scale) = (x @ kernel) * scale (int8_matmul: on TPU and GPU the kernel
is converted inside the dot; on CPU an int8 x int8 dot). Decode, which reads every weight once per step, reads a
quarter of float32's bytes.

The embedding is quantized by rows (one scale per token: the output channels of a tied LM head).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

INT8_MAX = 127


def quantize(w: np.ndarray, contract_axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(int8 kernel, float32 scale) of a float weight on the host: scale over the output axes (all but
    contract_axes), the kernel rounded to the nearest step. An all-zero channel gets scale 1."""
    w = np.asarray(w, np.float32)
    scale = np.max(np.abs(w), axis=contract_axes, keepdims=True) / INT8_MAX
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    kernel = np.clip(np.rint(w / scale), -INT8_MAX, INT8_MAX).astype(np.int8)
    return kernel, np.squeeze(scale, axis=contract_axes)


def dequantize(kernel, scale, contract_axes: tuple[int, ...]):
    """The float32 weight an int8 kernel and its scale stand for (tests, references)."""
    return np.asarray(kernel, np.float32) * np.expand_dims(np.asarray(scale, np.float32), contract_axes)


def int8_matmul(x, kernel, scale, contract: int, method: str):
    """x [rows, K] @ the int8 kernel (contracted on its axis `contract`, the output on the other) times the output
    channels' scale: [rows, N] in x's dtype. Two methods, the same result to ~1e-5 (relative):

    "dequantize": the kernel converted to x's dtype inside the dot (where XLA can fuse the convert into it; on this
    CPU it does for the layers' projections, not for a 49152 x 576 LM head).
    "int8_dot": each row of x split in two int8 rows, its absmax-scaled rounding and the rounding of what that leaves
    (about 15 bits in all, per token), then one int8 x int8 dot with int32 accumulation over the 2 x rows. XLA's CPU
    backend runs it in XNNPACK's int8 kernels, where it would first write a converted kernel out in floats; one int8
    row per row in every matmul cost +3.5% perplexity on the default model, the pair none measurable.
    """
    dims = (((1,), (contract,)), ((), ()))
    if method == "dequantize":
        return jax.lax.dot_general(x, kernel.astype(x.dtype), dims) * scale.astype(x.dtype)
    rows = x.shape[0]
    x32 = x.astype(jnp.float32)
    high, high_scale = _quantize_rows(x32)
    low, low_scale = _quantize_rows(x32 - high.astype(jnp.float32) * high_scale)
    acc = jax.lax.dot_general(jnp.concatenate([high, low]), kernel, dims, preferred_element_type=jnp.int32)
    acc = acc.astype(jnp.float32)
    return ((acc[:rows] * high_scale + acc[rows:] * low_scale) * scale).astype(x.dtype)


def _quantize_rows(x):
    """(int8 rows, float32 scale per row [rows, 1]): each row of x by its absmax."""
    x_scale = jnp.max(jnp.abs(x), axis=1, keepdims=True) / INT8_MAX
    x_scale = jnp.where(x_scale > 0, x_scale, 1.0)
    return jnp.clip(jnp.rint(x / x_scale), -INT8_MAX, INT8_MAX).astype(jnp.int8), x_scale


def lm_head_method(platform: str | None = None) -> str:
    """The int8_matmul method of the LM head (the largest matrix by far) on `platform` (default: jax's default
    backend): "int8_dot" on CPU, where
    XLA writes the whole converted table out in floats before a "dequantize" dot (measured: 73 ms against 5.5 ms in
    float32 for SmolLM2's 49152 x 576 at one row); "dequantize" on TPU and GPU. The layers' projections, small enough
    for the convert to cost less than the bytes it saves, always "dequantize"."""
    return "int8_dot" if (platform or jax.default_backend()) == "cpu" else "dequantize"


def random_int8(key, shape, dtype=jnp.int8):
    return jax.random.randint(key, shape, -INT8_MAX, INT8_MAX + 1, jnp.int32).astype(dtype)


def fan_in_scale(fan_in: int):
    # Uniform integers in [-127, 127] have standard deviation ~73.3: scaled to 1 / sqrt(fan_in) (LeCun's).
    def init(key, shape, dtype=jnp.float32):
        return jnp.full(shape, 1.0 / (73.3 * fan_in**0.5), dtype)

    return init


class Int8DenseGeneral(nn.Module):
    """nn.DenseGeneral (over the last `len(axis)` axes of x, `axis` negative) with an int8 kernel and a float32
    scale per output feature; the same parameter names and shapes (kernel [in..., out...], bias [out...]), plus
    `scale` [out...]."""

    features: int | tuple[int, ...]
    axis: int | tuple[int, ...] = -1
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    method: str = "dequantize"  # see int8_matmul

    @nn.compact
    def __call__(self, x):
        features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
        axes = (self.axis,) if isinstance(self.axis, int) else tuple(self.axis)
        in_shape = tuple(x.shape[a] for a in axes)
        kernel = self.param("kernel", random_int8, in_shape + features, jnp.int8)
        scale = self.param("scale", fan_in_scale(int(np.prod(in_shape))), features, jnp.float32)
        batch = x.shape[: x.ndim - len(axes)]
        flat = x.reshape(int(np.prod(batch)), int(np.prod(in_shape)))
        y = int8_matmul(flat, kernel.reshape(flat.shape[1], -1), scale.reshape(-1), 0, self.method)
        y = y.reshape(*batch, *features)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, features, self.dtype)
        return y


class Int8Embed(nn.Module):
    """nn.Embed with an int8 table and a float32 scale per row (token): `embedding` [V, D], `scale` [V]."""

    num_embeddings: int
    features: int
    dtype: jnp.dtype = jnp.float32
    method: str = "dequantize"  # of `attend`, see int8_matmul

    def setup(self):
        self.embedding = self.param("embedding", random_int8, (self.num_embeddings, self.features), jnp.int8)
        self.scale = self.param("scale", fan_in_scale(self.features), (self.num_embeddings,), jnp.float32)

    def __call__(self, ids):
        rows = jnp.take(self.embedding, ids, axis=0).astype(self.dtype)
        return rows * jnp.take(self.scale, ids, axis=0)[..., None].astype(self.dtype)

    def attend(self, x):
        """x [..., D] against every row: a tied LM head's logits [..., V]."""
        flat = x.reshape(-1, x.shape[-1])
        return int8_matmul(flat, self.embedding, self.scale, 1, self.method).reshape(*x.shape[:-1], -1)
