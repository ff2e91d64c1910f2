"""A projection of pre-quantized weights (jaxpage.config.weight_quantization), multiplied inside the jitted step.

The codes stay as stored in device memory (int4 packed two to a byte by XLA, int8, float8_e4m3fn; a CPU holds them
as code_dtype says); each product reads them and dequantizes inside the dot: W = (codes - zero) * scale, the scale and
zero point of a block broadcast over its rows and columns. Per output channel or per tensor, the scale multiplies the
product's columns instead; in groups of input rows, each group is its own product (grouped_matmul), except where
quantized_matmul says XLA does better with the layer's dequantized weight (CPUs). On a GPU, weight-only codes are
multiplied by pallas_kernels.gpu_quantized_matmul (the codes read as stored, converted in registers, nothing but the
product written); other shapes as on a TPU but from rows of half a group through the dequantized weight. With
act order the activations' columns are permuted as the codes' rows were when they loaded (jaxpage.models.quantized.
tensors).

Activations: weight-only schemes multiply the activations as they are. W8A8 int8 quantizes each token's activations
to int8 (by its absmax, or by the checkpoint's static `input_scale`) and multiplies int8 by int8 into int32 (the TPU's
MXU, the GPU's tensor cores, XNNPACK on a CPU). FP8 activations are quantized to float8_e4m3fn the same way and
multiplied in FP8 on chips that have FP8 products (`fp8_products`: NVIDIA Hopper and later); elsewhere the FP8 weights
are dequantized to the model's dtype in the product and the activations left as they are.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.config.weight_quantization import WeightQuantization
from jaxpage.models.int8 import INT8_MAX
from jaxpage.models.quantized.tensors import CODE_DTYPES
from pallas_kernels import gpu_quantized_matmul

FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
# jaxpage's projection names -> the checkpoint's (WeightQuantization.quantized)
PROJECTIONS = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj", "lm_head": "lm_head",
}  # fmt: skip


def is_quantized(scheme: WeightQuantization | None, name: str) -> bool:
    """Whether projection `name` (jaxpage's: "q_proj", "lm_head") is stored quantized under `scheme`."""
    return scheme is not None and PROJECTIONS.get(name) in scheme.quantized


def code_dtype(scheme: WeightQuantization, platform: str | None = None) -> jnp.dtype:
    """The dtype the codes are held in on `platform` (default: jax's default backend): the scheme's, except on a CPU
    4-bit codes one to an int8 (jax's CPU runtime keeps int4 arrays a byte an element, in a layout its compiled
    programs do not take; XLA packs int4 two to a byte on TPUs and GPUs) and FP8 codes as float16."""
    cpu = (platform or jax.default_backend()) == "cpu"
    if scheme.weight_dtype == "int4" and cpu:
        return jnp.dtype(jnp.int8)
    if scheme.weight_dtype == "float8_e4m3fn" and cpu:
        # XLA:CPU converts FP8 (and bfloat16) in software, 12x slower than int8 (one request of 64 tokens of the
        # default model: 8.1 s against 0.7 s); float16 holds every e4m3 value exactly and converts in hardware
        return jnp.dtype(jnp.float16)
    return jnp.dtype(CODE_DTYPES[scheme.weight_dtype])


def with_device_codes(params: dict, scheme: WeightQuantization | None, platform: str | None = None) -> dict:
    """The parameter tree (numpy, as loaded: codes in int8 or float8_e4m3fn) with every projection's codes in
    code_dtype on `platform`."""
    if scheme is None:
        return params
    dtype = code_dtype(scheme, platform)

    def convert(node):
        if not isinstance(node, dict):
            return node
        return {k: (np.asarray(v).astype(dtype) if k == "qweight" else convert(v)) for k, v in node.items()}

    return convert(params)


def fp8_products(platform: str | None = None) -> bool:
    """Whether `platform` (default: jax's default backend) multiplies FP8 by FP8: NVIDIA GPUs (Hopper and later run
    it on their tensor cores; XLA upcasts on older ones). TPU v5e and CPUs dequantize the weights instead."""
    return (platform or jax.default_backend()) == "gpu"


def block_shape(scheme: WeightQuantization, in_features: int, out_features: int) -> tuple[int, int]:
    """(input rows, output columns) a scale covers in a [in, out] weight: the scheme's block, 0 read as the axis."""
    rows, cols = scheme.block
    return (rows or in_features), (cols or out_features)


def broadcast_blocks(blocks: jax.Array, rows: int, cols: int, shape: tuple[int, int]) -> jax.Array:
    """[in blocks, out blocks] -> [in, out]: each block's value over its rows x cols (XLA fuses this into its user)."""
    gk, gn = blocks.shape
    full = jnp.broadcast_to(blocks[:, None, :, None], (gk, rows, gn, cols)).reshape(gk * rows, gn * cols)
    return full[: shape[0], : shape[1]]


def dequantize(params: dict, scheme: WeightQuantization, dtype) -> jax.Array:
    """The [in, out] weight the codes stand for, in `dtype` (inside a jitted product XLA fuses it into the dot)."""
    codes = params["qweight"]
    rows, cols = block_shape(scheme, *codes.shape)
    w = codes.astype(jnp.float32)
    if "qzero" in params:
        w = w - broadcast_blocks(params["qzero"].astype(jnp.float32), rows, cols, codes.shape)
    return (w * broadcast_blocks(params["qscale"], rows, cols, codes.shape)).astype(dtype)


def quantized_matmul(
    x: jax.Array, params: dict, scheme: WeightQuantization, platform: str | None = None, stacked=None
) -> jax.Array:
    """x [rows, in] @ the projection's weight [in, out] -> [rows, out] in x's dtype, as `platform` (default: jax's
    default backend) multiplies it fastest without writing the dequantized weight out (see the module docstring and
    grouped_matmul). stacked: (every layer's codes [layers, in, out], this layer's index), which the GPU kernel reads
    in place of params["qweight"] (this layer's slice, which XLA:GPU would copy for it)."""
    platform = platform or jax.default_backend()
    if "qperm" in params:
        x = jnp.take(x, params["qperm"], axis=1)
    if platform == "gpu" and gpu_kernel(scheme, *params["qweight"].shape):
        return _gpu_kernel_matmul(x, params, scheme, stacked)
    if platform == "gpu":
        # Tie the codes to the activations: XLA:GPU would otherwise convert every layer's weights (which need nothing
        # else) before the first layer runs, holding them all at once (an 8B model's: 25 GiB).
        x, codes = jax.lax.optimization_barrier((x, params["qweight"]))
        params = params | {"qweight": codes}
    codes, scale = params["qweight"], params["qscale"]
    columns_scaled = scheme.block[0] == 0 and "qzero" not in params  # one scale per output column (or tensor)
    quantize_activations = scheme.activations == "int8" or (scheme.activations is not None and fp8_products(platform))
    if columns_scaled:
        column_scale = broadcast_blocks(scale, 1, block_shape(scheme, *codes.shape)[1], (1, codes.shape[1]))
        if not quantize_activations:  # the codes converted inside the dot, the scale on its output columns
            return jnp.dot(x, codes.astype(x.dtype)) * column_scale.astype(x.dtype)
        x_codes, x_scale = _quantize_activations(x, scheme.activations, params.get("input_scale"))
        acc_type = jnp.int32 if scheme.activations == "int8" else jnp.float32
        acc = jax.lax.dot_general(x_codes, codes, (((1,), (0,)), ((), ())), preferred_element_type=acc_type)
        return (acc.astype(jnp.float32) * x_scale * column_scale).astype(x.dtype)
    group = block_shape(scheme, *codes.shape)[0]
    if platform == "cpu" or platform == "gpu" and x.shape[0] >= group // 2:
        # XLA:GPU writes the partial products out (rows x groups x out), more than the dequantized weight from here
        # on; it writes that weight out here, once (shapes the kernel does not tile). XLA:CPU runs the batched group
        # products slower than it writes a layer's weight out (the default model in W4A16, one request of 64 tokens:
        # 1.6 s against 0.9 s).
        return jnp.dot(x, dequantize(params, scheme, x.dtype))
    if platform == "tpu" and x.shape[0] == 1:  # XLA:TPU fuses one row's product only as two rows' (a zero row)
        return grouped_matmul(jnp.pad(x, ((0, 1), (0, 0))), params, scheme)[:1]
    return grouped_matmul(x, params, scheme)


def gpu_kernel(scheme: WeightQuantization, in_features: int, out_features: int) -> bool:
    """Whether a GPU multiplies this projection with pallas_kernels.gpu_quantized_matmul: weight-only codes (int4,
    int8, FP8; activations left as they are) in shapes the kernel tiles."""
    group = block_shape(scheme, in_features, out_features)[0]
    return scheme.activations is None and gpu_quantized_matmul.supported(in_features, out_features, group)


def _gpu_kernel_matmul(x: jax.Array, params: dict, scheme: WeightQuantization, stacked=None) -> jax.Array:
    """x @ the weight by pallas_kernels.gpu_quantized_matmul, from `stacked` (every layer's codes and this layer's
    index: see quantized_matmul) where given: the scales and zero points of column blocks given per column (an
    array of groups x outputs, small beside the codes)."""
    in_features, out_features = params["qweight"].shape
    rows, cols = block_shape(scheme, in_features, out_features)
    codes, layer = stacked if stacked is not None else (params["qweight"], None)
    per_column = lambda blocks: broadcast_blocks(blocks, 1, cols, (blocks.shape[0], out_features))  # noqa: E731
    zero = params.get("qzero")
    y = gpu_quantized_matmul.gpu_quantized_matmul_or_interpret(
        x, codes, per_column(params["qscale"]), None if zero is None else per_column(zero), layer,
        group=rows, int4=scheme.weight_dtype == "int4",
    )  # fmt: skip
    return y.astype(x.dtype)


def grouped_matmul(x: jax.Array, params: dict, scheme: WeightQuantization) -> jax.Array:
    """x [rows, in] @ the weight of codes in groups of input rows: each group's product with its codes converted
    inside the dot (a batched dot over the groups), then scaled by the group's scales and summed over the groups; zero
    points subtract each group's sum of x times zero * scale. XLA:TPU fuses the whole (nothing the size of the
    weight, whatever the rows); XLA:GPU writes the partial products [groups, rows, out] out. A last group shorter
    than the others (in % group) is its own product."""
    codes, scale = params["qweight"], params["qscale"]
    in_features, out_features = codes.shape
    group, cols = block_shape(scheme, in_features, out_features)
    full = in_features // group * group
    scale = broadcast_blocks(scale, 1, cols, (scale.shape[0], out_features)).astype(jnp.float32)  # [groups, out]
    zero_scale = None
    if "qzero" in params:
        zero = broadcast_blocks(params["qzero"], 1, cols, (scale.shape[0], out_features)).astype(jnp.float32)
        zero_scale = zero * scale

    def part(x_part, codes_part, groups: slice):
        n = groups.stop - groups.start
        xg = x_part.reshape(x.shape[0], n, -1)
        cg = codes_part.reshape(n, -1, out_features).astype(x.dtype)
        dims = (((2,), (1,)), ((1,), (0,)))  # contract each group's rows, batched over the groups
        partial = jax.lax.dot_general(xg, cg, dims, preferred_element_type=jnp.float32)  # [n, rows, out]
        y = jnp.sum(partial * scale[groups, None, :], axis=0)
        if zero_scale is not None:
            y = y - jnp.dot(jnp.sum(xg.astype(jnp.float32), axis=2), zero_scale[groups])
        return y

    n_full = full // group
    y = part(x[:, :full], codes[:full], slice(0, n_full)) if n_full else 0.0
    if full < in_features:
        y = y + part(x[:, full:], codes[full:], slice(n_full, n_full + 1))
    return y.astype(x.dtype)


def _quantize_activations(x: jax.Array, dtype: str, static_scale: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(codes of x in `dtype`, float32 scale per row [rows, 1]): by each row's absmax, or the static scale, as
    compressed-tensors defines them: the absmax over half the code range (int8: 255 / 2, so that -128 is used too;
    float8_e4m3fn: 448), the codes rounded half to even and clipped to the range."""
    low, high = (-INT8_MAX - 1, INT8_MAX) if dtype == "int8" else (-FP8_MAX, FP8_MAX)
    x32 = x.astype(jnp.float32)
    # True divisions, as the format's own code divides (XLA would multiply by reciprocals, one rounding off, which
    # moves a row's absmax, exactly half a step past the last code, across the rounding boundary now and then).
    if static_scale is None:
        half_range = jax.lax.optimization_barrier(jnp.full((x.shape[0], 1), (high - low) / 2, jnp.float32))
        scale = jnp.max(jnp.abs(x32), axis=1, keepdims=True) / half_range
        scale = jnp.where(scale > 0, scale, 1.0)
    else:
        scale = jnp.broadcast_to(static_scale.astype(jnp.float32), (x.shape[0], 1))
    divisor = jax.lax.optimization_barrier(jnp.broadcast_to(scale, x32.shape))
    scaled = jnp.clip(x32 / divisor, low, high)
    codes = jnp.rint(scaled).astype(jnp.int8) if dtype == "int8" else scaled.astype(jnp.float8_e4m3fn)
    return codes, scale


def _zeros(dtype):
    def init(key, shape, _=None):
        return jnp.zeros(shape, dtype)

    return init


def _ones(key, shape, dtype=jnp.float32):
    return jnp.ones(shape, dtype)


class QuantizedDense(nn.Module):
    """nn.DenseGeneral (over the last `len(axis)` axes of x, `axis` negative) with pre-quantized weights: qweight
    [in, out] (the input and output axes flattened, codes of the scheme's dtype), qscale float32 [in blocks, out
    blocks], qzero int8 (asymmetric schemes), qperm int32 [in] (act order), input_scale [] (static activations);
    bias [out...] in the model's dtype as nn.DenseGeneral's."""

    features: int | tuple[int, ...]
    scheme: WeightQuantization
    axis: int | tuple[int, ...] = -1
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    platform: str | None = None  # the one compiled for (default: jax's default backend)

    @nn.compact
    def __call__(self, x, stacked=None):
        """stacked: every layer's codes and this layer's index, for the GPU kernel (see quantized_matmul)."""
        features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
        axes = (self.axis,) if isinstance(self.axis, int) else tuple(self.axis)
        in_features, out_features = int(np.prod([x.shape[a] for a in axes])), int(np.prod(features))
        rows, cols = block_shape(self.scheme, in_features, out_features)
        blocks = (-(-in_features // rows), -(-out_features // cols))
        params = {
            "qweight": self.param(
                "qweight", _zeros(code_dtype(self.scheme, self.platform)), (in_features, out_features)
            ),
            "qscale": self.param("qscale", _ones, blocks),
        }
        if not self.scheme.symmetric:
            params["qzero"] = self.param("qzero", _zeros(jnp.int8), blocks)
        if self.scheme.act_order:
            params["qperm"] = self.param(
                "qperm", lambda key, shape: jnp.arange(shape[0], dtype=jnp.int32), (in_features,)
            )
        if self.scheme.static_activations:
            params["input_scale"] = self.param("input_scale", _ones, ())
        batch = x.shape[: x.ndim - len(axes)]
        flat = x.reshape(int(np.prod(batch)), in_features)
        y = quantized_matmul(flat, params, self.scheme, self.platform, stacked).reshape(*batch, *features)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, features, self.dtype)
        return y
