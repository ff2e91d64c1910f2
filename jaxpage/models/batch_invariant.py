"""Batch invariance (engine argument `batch_invariant`): matrix products whose every row is computed the same way
whatever else the step holds.

XLA compiles a product x [T, K] @ w [K, N] by its shape: on CPU, measured with jax 0.10, a row of x times w gives
other bits at T = 2..48 than at T = 1 or T >= 64 (other kernels, other orders of the sum over K), and a GPU's
libraries pick split-K and tile configurations by shape likewise. So a token's hidden states, K/V and logits would
depend on how many tokens its step has. `invariant_dot_general` instead multiplies the rows ROW_TILE at a time, in a
loop (lax.map: XLA cannot merge the tiles back into one product) over tiles padded with zero rows: every row of every
step goes through the one product of shape [ROW_TILE, K] @ [K, N], so its bits depend on its own values only.

The loop is also what keeps a tile's ops apart from their neighbours: XLA fuses ops across no loop boundary, and a
fused multiply and add is one rounding (a fused multiply-add: XLA's CPU and GPU compilers contract them), two apart.
A step of one tile would have a loop of one trip, which XLA replaces by its body (WhileLoopSimplifier); the body then
fused with the ops around it (measured on CPU: a norm's last multiply and the residual add after it, Gemma's sandwich
norms, became one multiply-add at 1..16 rows and not at 17), so every tile's loop keeps even one trip
(KEEP_ONE_TRIP_LOOP). A tile's ops are named ROW_TILE_SCOPE in the compiled program's metadata, where a test reads
that no fusion joins them with others (jaxpage.benchmarks.hlo_fusions).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.xla_metadata import set_xla_metadata

ROW_TILE = 16  # rows per product: a batch-32 decode step is two products (as fast as one there); a lone row is 16
# The frontend attribute by which XLA's WhileLoopSimplifier keeps a loop of one trip a loop (the module docstring).
KEEP_ONE_TRIP_LOOP = {"skip-simplify-while-loops_trip-count-one": "true"}
ROW_TILE_SCOPE = "row_tile"  # the name scope of a tile's ops (in the op_name metadata of the compiled HLO)


def invariant_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """lax.dot_general for products whose contracting dimensions are lhs's last ones and that have no batch
    dimensions (the model's projections, as nn.DenseGeneral calls it), ROW_TILE rows of lhs at a time (in_row_tiles);
    lhs's other dimensions flattened into rows. The same result as lax.dot_general up to the order of each row's sum."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    lhs_contract = tuple(d % lhs.ndim for d in lhs_contract)
    num_free = lhs.ndim - len(lhs_contract)
    if lhs_batch or rhs_batch or lhs_contract != tuple(range(num_free, lhs.ndim)):
        raise ValueError(f"invariant_dot_general: unsupported dimension numbers {dimension_numbers}")
    free_shape, contract_shape = lhs.shape[:num_free], lhs.shape[num_free:]
    rows = math.prod(free_shape)
    tile_numbers = ((tuple(range(1, 1 + len(contract_shape))), tuple(rhs_contract)), ((), ()))

    def product(tile):  # [ROW_TILE, *contract_shape] -> [ROW_TILE, *rhs's free dimensions]
        return lax.dot_general(tile, rhs, tile_numbers, precision, preferred_element_type=preferred_element_type)

    y = in_row_tiles(product, rows, lhs.reshape(rows, *contract_shape))
    return y.reshape(*free_shape, *y.shape[1:])


def rowwise(fn, x: jax.Array) -> jax.Array:
    """fn (a function of rows: [n, D] -> [n, ...], each row's result its own) of x [..., D], ROW_TILE rows at a time
    (in_row_tiles): a reduction along the rows, whose order XLA picks by their number (measured on CPU: a
    row's mean of squares differs from T >= 8 rows on), is then the same for every row of every step."""
    free_shape, width = x.shape[:-1], x.shape[-1]
    rows = math.prod(free_shape)
    y = in_row_tiles(fn, rows, x.reshape(rows, width))
    return y.reshape(*free_shape, *y.shape[1:])


def in_row_tiles(fn, num_rows: int, *args):
    """fn(*args) ROW_TILE rows at a time, in a loop over tiles of one shape that stays a loop at one tile (the module
    docstring): the mode's one tiling, for a function of rows whose every result is per row (a projection's product,
    a norm, a sampler: their sums, softmaxes and cumulative sums along each row are then done in one shape). Each
    array of args whose leading dimension is num_rows * m (m positions per row) is cut after every ROW_TILE rows, the
    last tile padded with zeros; the others (scalars) reach every tile whole. fn's results, of ROW_TILE * m' rows
    each, are put back together and cut to num_rows * m'."""
    tiles = -(-num_rows // ROW_TILE)
    leaves, treedef = jax.tree.flatten(args)
    split = [x.ndim > 0 and x.shape[0] % num_rows == 0 for x in leaves]

    def cut(x):
        per_row = x.shape[0] // num_rows
        x = jnp.pad(x, ((0, (tiles * ROW_TILE - num_rows) * per_row),) + ((0, 0),) * (x.ndim - 1))
        return x.reshape(tiles, ROW_TILE * per_row, *x.shape[1:])

    def tile_fn(tile_leaves):
        pieces = iter(tile_leaves)
        whole = [next(pieces) if s else x for x, s in zip(leaves, split, strict=True)]
        with jax.named_scope(ROW_TILE_SCOPE):
            return fn(*jax.tree.unflatten(treedef, whole))

    with set_xla_metadata(**KEEP_ONE_TRIP_LOOP):
        out = lax.map(tile_fn, [cut(x) for x, s in zip(leaves, split, strict=True) if s])

    def join(y):
        per_row = y.shape[1] // ROW_TILE
        return y.reshape(tiles * ROW_TILE * per_row, *y.shape[2:])[: num_rows * per_row]

    return jax.tree.map(join, out)


def invariant_matmul(x: jax.Array, w: jax.Array, preferred_element_type=None) -> jax.Array:
    """x [..., K] @ w [K, N] by invariant_dot_general."""
    return invariant_dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=preferred_element_type)


def batch_invariant_config(config, enabled: bool):
    """ModelConfig `config` as the engine runs it with the engine argument batch_invariant `enabled` (its
    batch_invariant set); ValueError for a mixture of experts, whose products group tokens by expert in shapes that
    depend on the batch."""
    if not enabled:
        return config
    if config.is_moe:
        raise ValueError(
            "engine argument batch_invariant: a mixture of experts multiplies each expert's tokens together "
            "(shapes that depend on the batch); not supported"
        )
    return dataclasses.replace(config, batch_invariant=True)
