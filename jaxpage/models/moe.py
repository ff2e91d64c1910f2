"""The mixture-of-experts feed-forward block of Mixtral, Qwen2-MoE and Qwen3-MoE: routing, the grouped expert
matmuls, and a dense reference.

A token's hidden state x [D] goes to `top_k` of E experts (each a SiLU-gated MLP, down(silu(gate(x)) * up(x)))
chosen by a linear router; their outputs are summed with the routing weights. Qwen2-MoE adds a shared expert, an
ordinary MLP on every token scaled by sigmoid(x @ shared_expert_gate).

The T*k (token, expert) assignments of a step are sorted by expert, so that each expert's tokens are one contiguous
group of rows; only those rows go through that expert (two ways, `METHODS`), never every expert for every token.
Shapes are static (always T*k rows, only the group sizes change), so a block compiles once per T.

Parameters (E = num_experts, D = hidden size, F = intermediate_size, S = shared_expert_intermediate_size):

    router/kernel                           [D, E]
    experts/{gate,up}_proj/kernel           [E, D, F]
    experts/down_proj/kernel                [E, F, D]
    shared_expert/{gate,up}_proj/kernel     [D, S]      (only with a shared expert)
    shared_expert/down_proj/kernel          [S, D]
    shared_expert_gate/kernel               [D, 1]

transformers keeps an expert's projections as torch linears [out, in] (checkpoints: one per expert; transformers 5
in memory: fused as experts.gate_up_proj [E, 2F, D], gate rows first, and experts.down_proj [E, D, F]); these are
their transposes.

int8 weights (jaxpage.models.int8): the experts' kernels are int8 with a float32 `scale` beside each, one per expert
and output channel ({gate,up}_proj scale [E, F], down_proj scale [E, D]). Both methods multiply by the converted int8
kernel and then scale the output columns: ragged_dot's result row by the scale of that row's expert, the expert
loop's chunk by scale[e]. The shared expert is quantized as the model's other projections; the router and the shared
expert's gate stay in floats (tiny, and rounding them would move tokens between experts).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxpage.models.int8 import Int8DenseGeneral, fan_in_scale, random_int8

# How the routed experts are computed (both from the rows sorted by expert):
#   "ragged_dot":  jax.lax.ragged_dot, the grouped matmul TPU and GPU lower natively. XLA's CPU backend has no such
#                  instruction: jax lowers it there to a masked dense product over every group ([E, T*k, D] masked
#                  copies of the rows), k times the work of computing every expert for every token (XLA's flop count
#                  says so; measured 0.6x to 1x the dense reference's speed).
#   "expert_loop": a loop over the experts that received rows, each multiplying its group in chunks of a fixed
#                  number of rows (loop_chunk_rows); the trip counts are data, the shapes are not. The CPU method.
METHODS = ("ragged_dot", "expert_loop")
# Every expert on every token, weighted by the routing (zero for the experts a token is not routed to): the reference
# of the tests and the baseline of the benchmarks (scripts/bench_moe*.py), never chosen by expert_method.
DENSE_REFERENCE = "dense_reference"


def expert_method(platform: str | None = None) -> str:
    """The METHODS entry for `platform` (default: jax's default backend): "expert_loop" on CPU, where ragged_dot is a
    dense product (see METHODS), "ragged_dot" on TPU and GPU."""
    return "expert_loop" if (platform or jax.default_backend()) == "cpu" else "ragged_dot"


def loop_chunk_rows(num_rows: int, num_experts: int) -> int:
    """Rows per matmul of the expert loop for `num_rows` (T*k) assignments over `num_experts` experts: the smallest
    power of two at least half the mean group size, within [8, 64]. Smaller chunks waste fewer rows past the end of a
    group, larger ones run fewer, more efficient matmuls; this rule was the fastest or within noise of it on CPU for
    Mixtral's 8 experts, top-2, at T = 32, 128 and 512 (scripts/bench_moe.py)."""
    half_mean_group = max(1, num_rows // (2 * num_experts))
    return min(64, max(8, 1 << (half_mean_group - 1).bit_length()))


def route(router_logits: jax.Array, top_k: int, normalize_topk: bool) -> tuple[jax.Array, jax.Array]:
    """The experts of each token and their weights, as transformers routes Mixtral, Qwen2-MoE and Qwen3-MoE.

    router_logits: [T, E] (x @ router kernel, in the model's dtype).
    Returns (weights [T, top_k] float32, expert_ids [T, top_k] int32), experts in decreasing order of their logit.

    The weights are the float32 softmax over all E experts taken at the chosen ones, divided by their sum when
    `normalize_topk`: Mixtral always (the same as a softmax over the k chosen logits), Qwen2-MoE and Qwen3-MoE when
    their config's norm_topk_prob is set. Among equal logits the lowest expert index comes first (jax.lax.top_k's
    order); experts are chosen by logit, which the softmax preserves. So a row of zeros (padding) goes to experts 0
    to k-1.
    """
    logits = router_logits.astype(jnp.float32)
    _, expert_ids = jax.lax.top_k(logits, top_k)
    weights = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), expert_ids, axis=-1)
    if normalize_topk:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, expert_ids.astype(jnp.int32)


PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _project(x, projection: dict):
    """x [R, in] through one projection {"kernel": [in, out], "scale": [out] (int8 kernels only)}."""
    kernel, scale = projection["kernel"], projection.get("scale")
    y = x @ kernel.astype(x.dtype)
    return y if scale is None else y * scale.astype(x.dtype)


def _gated_mlp(x, projections: dict):
    """down(silu(gate(x)) * up(x)) for rows x [R, D] and one expert's projections (see _project)."""
    hidden = nn.silu(_project(x, projections["gate_proj"])) * _project(x, projections["up_proj"])
    return _project(hidden, projections["down_proj"])


def _ragged_project(rows, projection: dict, group_sizes, row_experts):
    """The rows (sorted by expert, group_sizes [E]) through their experts' projection: [N, out]."""
    y = jax.lax.ragged_dot(rows, projection["kernel"].astype(rows.dtype), group_sizes)
    scale = projection.get("scale")
    return y if scale is None else y * scale[row_experts].astype(rows.dtype)


def routed_experts(
    x: jax.Array,  # [T, D]
    experts: dict,  # {gate_proj, up_proj: {"kernel": [E, D, F]}, down_proj: {"kernel": [E, F, D]}} (+ int8 "scale")
    weights: jax.Array,  # [T, k] float32, from route
    expert_ids: jax.Array,  # [T, k] int32, from route
    method: str,
    first_expert: jax.Array | int = 0,
) -> jax.Array:
    """out[t] = sum over j of weights[t, j] * (expert expert_ids[t, j])(x[t]): [T, D] float32, each expert computed
    only on the rows routed to it, by `method` (one of METHODS).

    Expert parallelism: `experts` are the E_local experts first_expert, first_expert + 1, ... of a shard; the
    assignments to other experts are left out (their rows sort after every local group and are neither computed nor
    added), so the shards' outputs sum to the whole."""
    if method not in (*METHODS, DENSE_REFERENCE):
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    num_tokens, top_k = expert_ids.shape
    num_experts = experts["gate_proj"]["kernel"].shape[0]
    local_ids = expert_ids.reshape(-1) - first_expert
    here = (local_ids >= 0) & (local_ids < num_experts)  # [T*k] assignments to this shard's experts
    if method == DENSE_REFERENCE:
        dense_weights = jnp.zeros((num_tokens, num_experts + 1), jnp.float32)  # a last column for other shards'
        rows = jnp.repeat(jnp.arange(num_tokens), top_k)
        dense_weights = dense_weights.at[rows, jnp.where(here, local_ids, num_experts)].set(weights.reshape(-1))
        return _every_expert(x, experts, dense_weights[:, :num_experts])
    flat_ids = jnp.where(here, local_ids, num_experts)  # the others: a group past the last, never computed
    # Stable: within an expert's group the rows keep token order.
    order = jnp.argsort(flat_ids, stable=True).astype(jnp.int32)  # [T*k] assignment at each sorted position
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)  # [E_local]
    rows = x[order // top_k]  # [T*k, D]
    if method == "ragged_dot":
        row_experts = jnp.minimum(flat_ids[order], num_experts - 1)  # [T*k] each sorted row's expert (int8 scales)
        gate = _ragged_project(rows, experts["gate_proj"], group_sizes, row_experts)
        hidden = nn.silu(gate) * _ragged_project(rows, experts["up_proj"], group_sizes, row_experts)
        out = _ragged_project(hidden, experts["down_proj"], group_sizes, row_experts)
    else:
        chunk = loop_chunk_rows(num_tokens * top_k, num_experts)
        out = _expert_loop(rows, experts, group_sizes, chunk)
    out = jnp.where(here[order][:, None], out, 0)  # rows of other shards' experts: nothing
    # Back to assignment order (`order` is a permutation: a scatter without collisions), then each token's k outputs
    # summed in float32 in one fixed order; a scatter-add's order is not fixed on GPU.
    out = jnp.zeros_like(out).at[order].set(out, unique_indices=True).reshape(num_tokens, top_k, -1)
    return jnp.einsum("tkd,tk->td", out.astype(jnp.float32), weights)


def _expert_loop(rows, experts: dict, group_sizes, chunk: int):
    """The rows [N, D] (sorted by expert, group_sizes [E]) through their experts: [N, D]. Experts with rows, in
    increasing order, each in chunks of `chunk` rows from its group's start. A chunk that runs past its group computes
    rows of the next groups with the wrong expert; those groups come later and write them again (rows past N land in
    the padding)."""
    num_rows, hidden_size = rows.shape
    num_experts = group_sizes.shape[0]
    starts = jnp.cumsum(group_sizes) - group_sizes  # [E]
    # Room for a whole chunk from any row < N (dynamic_slice would move a chunk that overhangs back to fit).
    padded = jnp.concatenate([rows, jnp.zeros((chunk, hidden_size), rows.dtype)])
    active = jnp.nonzero(group_sizes > 0, size=num_experts, fill_value=0)[0]  # [E], the first count_nonzero valid

    def expert(i, out):
        e = active[i]
        mine = jax.tree.map(lambda a: a[e], experts)  # sliced once per expert, not per chunk

        def chunk_of_rows(j, out):
            start = starts[e] + j * chunk
            y = _gated_mlp(jax.lax.dynamic_slice_in_dim(padded, start, chunk), mine)
            return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), start, 0)

        return jax.lax.fori_loop(0, (group_sizes[e] + chunk - 1) // chunk, chunk_of_rows, out)

    out = jax.lax.fori_loop(0, jnp.count_nonzero(group_sizes), expert, jnp.zeros_like(padded))
    return out[:num_rows]


def _shared_expert_reference(x: jax.Array, params: dict) -> jax.Array:
    """Qwen2-MoE's shared expert on every row of x [T, D]: sigmoid(x @ shared_expert_gate) * mlp(x), [T, D]."""
    out = _gated_mlp(x, params["shared_expert"])
    return nn.sigmoid(_project(x, params["shared_expert_gate"])) * out


def _dequantized(projection: dict, dtype) -> jax.Array:
    """An expert projection's kernels [E, in, out] in `dtype` (int8 ones times their scale [E, out])."""
    kernel = projection["kernel"].astype(dtype)
    return kernel if "scale" not in projection else kernel * projection["scale"][:, None, :].astype(dtype)


def _every_expert(x, experts: dict, dense_weights) -> jax.Array:
    """sum over e of dense_weights[:, e] * expert e (x): every expert on every row of x [T, D], [T, D] float32."""
    experts = {name: _dequantized(experts[name], x.dtype) for name in PROJECTIONS}
    # Expert-major products ([E, T, F]): batched over the kernels' leading axis, no transposed copy of them (measured
    # 1.1x to 1.4x faster than token-major on CPU, so the benchmarks' baseline is not a weak one).
    gate = jnp.einsum("td,edf->etf", x, experts["gate_proj"])
    up = jnp.einsum("td,edf->etf", x, experts["up_proj"])
    every_expert = jnp.einsum("etf,efd->etd", nn.silu(gate) * up, experts["down_proj"])  # [E, T, D]
    return jnp.einsum("etd,te->td", every_expert.astype(jnp.float32), dense_weights)


def moe_dense_reference(params: dict, x: jax.Array, top_k: int, normalize_topk: bool) -> jax.Array:
    """MoEBlock's output [T, D] for x [T, D] and its parameters, computing every expert on every token (E/k times the
    routed work) and weighting by the routing weights; the shared expert when the parameters have one. For tests and
    as the benchmarks' baseline."""
    weights, expert_ids = route(_project(x, params["router"]), top_k, normalize_topk)
    out = routed_experts(x, params["experts"], weights, expert_ids, DENSE_REFERENCE).astype(x.dtype)
    if "shared_expert" in params:
        out = out + _shared_expert_reference(x, params)
    return out


def _dense(features: int, dtype, quantized: bool, name: str) -> nn.Module:
    """A projection without bias: nn.Dense, or its int8 form (kernel int8, `scale` per output feature)."""
    if quantized:
        return Int8DenseGeneral(features, -1, False, dtype, "dequantize", name=name)
    return nn.Dense(features, use_bias=False, dtype=dtype, param_dtype=dtype, name=name)


class SharedExpert(nn.Module):
    """The shared expert's SiLU-gated MLP (the parameters shared_expert/{gate,up,down}_proj/kernel)."""

    intermediate_size: int
    dtype: jnp.dtype
    quantized: bool = False

    @nn.compact
    def __call__(self, x):
        def dense(features, name):
            return _dense(features, self.dtype, self.quantized, name)

        hidden = nn.silu(dense(self.intermediate_size, "gate_proj")(x)) * dense(self.intermediate_size, "up_proj")(x)
        return dense(x.shape[-1], "down_proj")(hidden)


class ExpertProjection(nn.Module):
    """One projection of every expert: `kernel` [E, in, out] (int8, with `scale` [E, out], when quantized). Called,
    it returns its parameters for routed_experts."""

    shape: tuple[int, int, int]
    dtype: jnp.dtype
    quantized: bool = False

    @nn.compact
    def __call__(self) -> dict:
        experts, fan_in, out = self.shape
        if not self.quantized:
            init = nn.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))  # fan-in per expert
            return {"kernel": self.param("kernel", init, self.shape, self.dtype)}
        kernel = self.param("kernel", random_int8, self.shape, jnp.int8)
        return {"kernel": kernel, "scale": self.param("scale", fan_in_scale(fan_in), (experts, out), jnp.float32)}


class Experts(nn.Module):
    """The routed experts' stacked projections (experts/{gate,up}_proj/kernel [E, D, F], experts/down_proj/kernel
    [E, F, D]) applied to the rows routed to each (routed_experts)."""

    num_experts: int  # this shard's, with expert parallelism
    intermediate_size: int
    dtype: jnp.dtype
    method: str
    quantized: bool = False
    expert_axis: str | None = None  # expert parallelism: shard i of this mesh axis holds experts i*E_local, ...

    @nn.compact
    def __call__(self, x, weights, expert_ids):
        e, d, f = self.num_experts, x.shape[-1], self.intermediate_size
        shapes = {"gate_proj": (e, d, f), "up_proj": (e, d, f), "down_proj": (e, f, d)}
        experts = {
            name: ExpertProjection(shape, self.dtype, self.quantized, name=name)() for name, shape in shapes.items()
        }
        first = 0 if self.expert_axis is None else jax.lax.axis_index(self.expert_axis) * e
        return routed_experts(x, experts, weights, expert_ids, self.method, first)


class MoEBlock(nn.Module):
    """The mixture-of-experts MLP of a decoder layer: x [..., D] -> [..., D] (parameters in the module docstring).

    Mixtral: normalize_topk=True, no shared expert. Qwen2-MoE: normalize_topk=norm_topk_prob (default False),
    shared_expert_intermediate_size from its config. Qwen3-MoE: normalize_topk=norm_topk_prob, no shared expert.
    `method`: one of METHODS; None: expert_method() of jax's default backend.

    The router's logits and the experts are computed in `dtype`, the routing weights and their sum over a token's
    experts in float32 (transformers rounds the weighted outputs to the model's dtype before summing them).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_topk: bool
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    dtype: jnp.dtype = jnp.float32
    method: str | None = None
    quantized: bool = False  # int8 weights (see the module docstring)
    # Expert parallelism (inside shard_map): the routed experts split over this mesh axis, num_experts / its size
    # per shard; the caller sums the shards' outputs (as tensor parallelism does).
    expert_axis: str | None = None
    expert_shards: int = 1

    @nn.compact
    def __call__(self, x):
        assert 1 <= self.top_k <= self.num_experts, (self.top_k, self.num_experts)
        flat = x.reshape(-1, x.shape[-1])
        router = _dense(self.num_experts, self.dtype, False, "router")  # floats even with int8 weights: routing
        weights, expert_ids = route(router(flat), self.top_k, self.normalize_topk)
        method = self.method or expert_method()
        local = self.num_experts // self.expert_shards
        experts = Experts(
            local, self.intermediate_size, self.dtype, method, self.quantized, self.expert_axis, name="experts"
        )
        out = experts(flat, weights, expert_ids).astype(self.dtype)
        if self.shared_expert_intermediate_size:
            shared_expert = SharedExpert(
                self.shared_expert_intermediate_size, self.dtype, self.quantized, name="shared_expert"
            )
            shared = shared_expert(flat)
            gate = _dense(1, self.dtype, False, "shared_expert_gate")
            out = out + nn.sigmoid(gate(flat)) * shared
        return out.reshape(x.shape)
