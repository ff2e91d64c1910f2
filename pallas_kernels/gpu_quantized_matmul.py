"""Weight-only quantized products for NVIDIA GPUs: activations times int4, int8 or FP8 codes with a scale (and zero
point) per output column and group of input rows, a Pallas kernel (Triton lowering) that reads the codes as the GPU
holds them and converts them in registers.

XLA:GPU multiplies by such weights only through a converted or dequantized weight it writes out first (an 8B FP8 decode
step: 56 MiB; W4A16 prefill: each layer's bfloat16 weight), or partial products per group, larger still; this kernel
writes nothing but the product.

Operands: x [M, K] (bfloat16, float16 or float32); codes [K, N]: int4 (XLA:GPU's layout, two's complement, two to a
byte), bitcast outside the kernel to uint8 [K, N / 2] (`int4_pairs`: byte j of row k holds column 2j in its low nibble
and 2j + 1 in its high nibble: a view, no copy), or int8 / float8_e4m3fn (any dtype x's converts from exactly); scale
[G, N] float32 and zero [G, N] int8 (or None) per group of `group` input rows, the last group shorter where `group`
does not divide K (per output channel: one group of K rows).

Grid (M / block_m, N / block_n). A program walks the input rows a tile at a time (tile: the largest power of two up
to 128 that divides both K and the group, so that a tile lies in one group): the x tile [block_m, tile] and the codes
tile [tile, block_n / parts] (parts: 2 for int4, a byte's two nibbles; 1 for 8-bit codes); each part's codes
(sign-extended nibbles, converted to x's dtype, exact) multiplied on the tensor cores in float32, less the tile's row
sums times the columns' zero points, times their scales, accumulated. int4's even and odd columns are written apart
([2, M, N / 2]); interleaving them outside is a copy of the output, not of the weight. M is padded to block_m (16 at
least: the tensor cores' smallest product), so one decode row costs 16 rows' products, which the weight's bytes
dominate.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_BLOCK_M = 16  # the tensor cores' smallest product
MAX_BLOCK_M = 64
MAX_TILE = 128
NUM_WARPS = 8


def tile_rows(in_features: int, group: int) -> int:
    """The input rows a program reads per step: the largest power of two up to MAX_TILE dividing both the inputs and
    the group (so every tile lies in one group); 0 where that is under 16 (no tensor-core product: not supported)."""
    tile = math.gcd(in_features, group, MAX_TILE)
    tile = 1 << (tile.bit_length() - 1)
    return tile if tile >= 16 and in_features % tile == 0 and group % tile == 0 else 0


def supported(in_features: int, out_features: int, group: int) -> bool:
    """Whether the kernel multiplies this weight: tiles of 16 rows at least, the columns in blocks of 64 or 128."""
    return tile_rows(in_features, group) > 0 and out_features % 64 == 0


def int4_pairs(codes: jax.Array) -> jax.Array:
    """int4 [..., N] -> uint8 [..., N / 2], two columns a byte (column 2j in the low nibble), as XLA packs int4 (int8
    codes, as a CPU holds int4 ones, are narrowed first)."""
    codes = codes.astype(jnp.int4)
    return jax.lax.bitcast_convert_type(codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2), jnp.uint8)


def _block_n(out_features: int) -> int:
    """Output columns a program computes: 128, or fewer where they do not divide the columns."""
    return next(b for b in (128, 64) if out_features % b == 0)


def _parts(tile: jax.Array, packed: bool, dtype) -> list[jax.Array]:
    """A codes tile as the column sets it holds, in `dtype`: a packed int4 tile's low and high nibbles
    (two's complement: the even and odd columns), or an 8-bit tile as it is."""
    if not packed:
        return [tile.astype(dtype)]
    value = tile.astype(jnp.int32)
    low, high = value & 15, (value >> 4) & 15
    return [(low - ((low >> 3) << 4)).astype(dtype), (high - ((high >> 3) << 4)).astype(dtype)]


def _dot(a, b):
    return plgpu.dot(a, b, allow_tf32=False if a.dtype == jnp.float32 else None)


def _kernel(layer_ref, x_ref, w_ref, s_ref, *refs, tile: int, group: int, tiles: int, packed: bool):
    *z_ref, o_ref = refs
    z_ref = z_ref[0] if z_ref else None
    parts, block_m, width = o_ref.shape
    layer = layer_ref[0]

    def step(i, acc):
        rows = pl.ds(pl.multiple_of(i * tile, tile), tile)
        x = x_ref[:, rows]
        g = (i * tile) // group
        sums = jnp.sum(x.astype(jnp.float32), axis=1)[:, None] if z_ref is not None else None
        out = []
        for part, (total, codes) in enumerate(zip(acc, _parts(w_ref[layer, rows, :], packed, x.dtype), strict=True)):
            product = _dot(x, codes)
            if sums is not None:
                product = product - sums * z_ref[part, g, :].astype(jnp.float32)[None, :]
            out.append(total + product * s_ref[part, g, :][None, :])
        return tuple(out)

    zeros = tuple(jnp.zeros((block_m, width), jnp.float32) for _ in range(parts))
    for part, total in enumerate(jax.lax.fori_loop(0, tiles, step, zeros)):
        o_ref[part] = total.astype(o_ref.dtype)


def _columns_apart(a: jax.Array, parts: int) -> jax.Array:
    """[G, N] -> [parts, G, N / parts]: column set p holds columns p, p + parts, ..."""
    return jnp.stack([a[:, p::parts] for p in range(parts)])


def gpu_quantized_matmul_or_interpret(x, codes, scale, zero, layer=None, *, group: int, int4: bool) -> jax.Array:
    """gpu_quantized_matmul compiled where the program is lowered for a GPU, and in Pallas' interpreter elsewhere (a
    CPU running the GPU's path: tests)."""
    return jax.lax.platform_dependent(
        x, codes, scale, zero, layer,
        cuda=functools.partial(gpu_quantized_matmul, group=group, int4=int4),
        default=functools.partial(gpu_quantized_matmul, group=group, int4=int4, interpret=True),
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("group", "int4", "interpret"))
def gpu_quantized_matmul(
    x: jax.Array,
    codes: jax.Array,
    scale: jax.Array,
    zero: jax.Array | None,
    layer: jax.Array | None = None,
    *,
    group: int,
    int4: bool,
    interpret: bool = False,
) -> jax.Array:
    """x [M, K] @ the weight [K, N] = (codes - zero) * scale, each scale and zero point over `group` input rows of
    one column: [M, N] in x's dtype. codes [K, N]: int4 values (`int4`: an int4 array, or an int8 one holding them as
    a CPU does), or int8 / float8_e4m3fn (float16 holding FP8 values on a CPU); or every layer's codes [L, K, N] and
    `layer` (int32 []), the kernel reading that layer's where they lie (XLA:GPU copies a slice of an array before
    giving it to a kernel); scale [ceil(K / group), N] float32; zero int8 alike, or None (symmetric)."""
    if layer is None:
        codes, layer = codes[None], 0
    m, k = x.shape
    n = codes.shape[-1]
    if not supported(k, n, group):
        raise ValueError(f"gpu_quantized_matmul: no tiling for {k} inputs in groups of {group}, {n} outputs")
    parts = 2 if int4 else 1
    tile = tile_rows(k, group)
    block_m = min(MAX_BLOCK_M, max(MIN_BLOCK_M, 1 << (m - 1).bit_length()))
    padded_m = -(-m // block_m) * block_m
    x = jnp.pad(x, ((0, padded_m - m), (0, 0)))
    block_n = _block_n(n)
    groups = scale.shape[0]
    kernel = functools.partial(_kernel, tile=tile, group=group, tiles=k // tile, packed=int4)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    codes = int4_pairs(codes) if int4 else codes
    operands = [layer, x, codes, _columns_apart(scale.astype(jnp.float32), parts)]
    side_spec = pl.BlockSpec((parts, groups, block_n // parts), lambda i, j: (0, 0, j))
    in_specs = [
        pl.BlockSpec((1,), lambda i, j: (0,)),
        pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
        pl.BlockSpec((codes.shape[0], k, block_n // parts), lambda i, j: (0, 0, j)),
        side_spec,
    ]
    if zero is not None:
        operands.append(_columns_apart(zero, parts))
        in_specs.append(side_spec)
    out = pl.pallas_call(
        kernel,
        grid=(padded_m // block_m, n // block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((parts, block_m, block_n // parts), lambda i, j: (0, i, j)),
        out_shape=jax.ShapeDtypeStruct((parts, padded_m, n // parts), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS),  # Triton (pallas_kernels.gpu_decode_attention)
        interpret=interpret,
        name="jaxpage_gpu_quantized_matmul",
    )(*operands)
    return jnp.stack(list(out), axis=-1).reshape(padded_m, n)[:m]
