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
    experts/{gate,up}_proj                  [E, D, F]
    experts/down_proj                       [E, F, D]
    shared_expert/{gate,up}_proj/kernel     [D, S]      (only with a shared expert)
    shared_expert/down_proj/kernel          [S, D]
    shared_expert_gate/kernel               [D, 1]

transformers keeps an expert's projections as torch linears [out, in], fused as experts.gate_up_proj [E, 2F, D]
(gate rows first) and experts.down_proj [E, D, F]; these are their transposes.

int8 expert weights would plug in as jaxpage.models.int8 does for the other projections: int8 kernels of the same
shapes with a float32 scale per expert and output channel ({gate,up}_proj scale [E, F], down_proj scale [E, D]).
Both methods multiply by the converted int8 kernel and then scale the output columns: ragged_dot's result row by
the scale of that row's expert (scale[sorted expert ids], [T*k, F]), the expert loop's chunk by scale[e].
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

# How the routed experts are computed (both from the rows sorted by expert):
#   "ragged_dot":  jax.lax.ragged_dot, the grouped matmul TPU and GPU lower natively. XLA's CPU backend has no such
#                  instruction: jax lowers it there to a masked dense product over every group ([E, T*k, D] masked
#                  copies of the rows), k times the work of computing every expert for every token (XLA's flop count
#                  says so; measured 0.6x to 1x the dense reference's speed).
#   "expert_loop": a loop over the experts that received rows, each multiplying its group in chunks of a fixed
#                  number of rows (loop_chunk_rows); the trip counts are data, the shapes are not. The CPU method.
METHODS = ("ragged_dot", "expert_loop")


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


def _gated_mlp(x, gate_kernel, up_kernel, down_kernel):
    """down(silu(gate(x)) * up(x)) for rows x [R, D] and kernels [D, F], [D, F], [F, D]."""
    return (nn.silu(x @ gate_kernel) * (x @ up_kernel)) @ down_kernel


def routed_experts(
    x: jax.Array,  # [T, D]
    gate_proj: jax.Array,  # [E, D, F]
    up_proj: jax.Array,  # [E, D, F]
    down_proj: jax.Array,  # [E, F, D]
    weights: jax.Array,  # [T, k] float32, from route
    expert_ids: jax.Array,  # [T, k] int32, from route
    method: str,
) -> jax.Array:
    """out[t] = sum over j of weights[t, j] * (expert expert_ids[t, j])(x[t]): [T, D] float32, each expert computed
    only on the rows routed to it, by `method` (one of METHODS)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    num_tokens, top_k = expert_ids.shape
    num_experts = gate_proj.shape[0]
    flat_ids = expert_ids.reshape(-1)
    # Stable: within an expert's group the rows keep token order.
    order = jnp.argsort(flat_ids, stable=True).astype(jnp.int32)  # [T*k] assignment at each sorted position
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)  # [E]
    rows = x[order // top_k]  # [T*k, D]
    if method == "ragged_dot":
        hidden = nn.silu(jax.lax.ragged_dot(rows, gate_proj, group_sizes))
        hidden = hidden * jax.lax.ragged_dot(rows, up_proj, group_sizes)
        out = jax.lax.ragged_dot(hidden, down_proj, group_sizes)
    else:
        chunk = loop_chunk_rows(num_tokens * top_k, num_experts)
        out = _expert_loop(rows, gate_proj, up_proj, down_proj, group_sizes, chunk)
    # Back to assignment order (`order` is a permutation: a scatter without collisions), then each token's k outputs
    # summed in float32 in one fixed order; a scatter-add's order is not fixed on GPU.
    out = jnp.zeros_like(out).at[order].set(out, unique_indices=True).reshape(num_tokens, top_k, -1)
    return jnp.einsum("tkd,tk->td", out.astype(jnp.float32), weights)


def _expert_loop(rows, gate_proj, up_proj, down_proj, group_sizes, chunk: int):
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
        kernels = gate_proj[e], up_proj[e], down_proj[e]  # sliced once per expert, not per chunk

        def chunk_of_rows(j, out):
            start = starts[e] + j * chunk
            y = _gated_mlp(jax.lax.dynamic_slice_in_dim(padded, start, chunk), *kernels)
            return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), start, 0)

        return jax.lax.fori_loop(0, (group_sizes[e] + chunk - 1) // chunk, chunk_of_rows, out)

    out = jax.lax.fori_loop(0, jnp.count_nonzero(group_sizes), expert, jnp.zeros_like(padded))
    return out[:num_rows]


def _shared_expert_reference(x: jax.Array, params: dict) -> jax.Array:
    """Qwen2-MoE's shared expert on every row of x [T, D]: sigmoid(x @ shared_expert_gate) * mlp(x), [T, D]."""
    mlp = params["shared_expert"]
    out = _gated_mlp(x, mlp["gate_proj"]["kernel"], mlp["up_proj"]["kernel"], mlp["down_proj"]["kernel"])
    return nn.sigmoid(x @ params["shared_expert_gate"]["kernel"]) * out


def moe_dense_reference(params: dict, x: jax.Array, top_k: int, normalize_topk: bool) -> jax.Array:
    """MoEBlock's output [T, D] for x [T, D] and its parameters, computing every expert on every token (E/k times the
    routed work) and weighting by the routing weights; the shared expert when the parameters have one. For tests and
    as the benchmarks' baseline."""
    weights, expert_ids = route(x @ params["router"]["kernel"], top_k, normalize_topk)
    experts = params["experts"]
    num_tokens, num_experts = x.shape[0], experts["gate_proj"].shape[0]
    dense_weights = jnp.zeros((num_tokens, num_experts), jnp.float32)
    dense_weights = dense_weights.at[jnp.arange(num_tokens)[:, None], expert_ids].set(weights)  # [T, E]
    # Expert-major products ([E, T, F]): batched over the kernels' leading axis, no transposed copy of them (measured
    # 1.1x to 1.4x faster than token-major on CPU, so the benchmarks' baseline is not a weak one).
    gate = jnp.einsum("td,edf->etf", x, experts["gate_proj"])
    up = jnp.einsum("td,edf->etf", x, experts["up_proj"])
    every_expert = jnp.einsum("etf,efd->etd", nn.silu(gate) * up, experts["down_proj"])  # [E, T, D]
    out = jnp.einsum("etd,te->td", every_expert.astype(jnp.float32), dense_weights).astype(x.dtype)
    if "shared_expert" in params:
        out = out + _shared_expert_reference(x, params)
    return out


class SharedExpert(nn.Module):
    """The shared expert's SiLU-gated MLP (the parameters shared_expert/{gate,up,down}_proj/kernel)."""

    intermediate_size: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        def dense(features, name):
            return nn.Dense(features, use_bias=False, dtype=self.dtype, param_dtype=self.dtype, name=name)

        hidden = nn.silu(dense(self.intermediate_size, "gate_proj")(x)) * dense(self.intermediate_size, "up_proj")(x)
        return dense(x.shape[-1], "down_proj")(hidden)


class Experts(nn.Module):
    """The routed experts' stacked kernels (experts/{gate,up}_proj [E, D, F], experts/down_proj [E, F, D]) applied to
    the rows routed to each (routed_experts)."""

    num_experts: int
    intermediate_size: int
    dtype: jnp.dtype
    method: str

    @nn.compact
    def __call__(self, x, weights, expert_ids):
        e, d, f = self.num_experts, x.shape[-1], self.intermediate_size
        init = nn.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))  # fan-in per expert
        gate_proj = self.param("gate_proj", init, (e, d, f), self.dtype)
        up_proj = self.param("up_proj", init, (e, d, f), self.dtype)
        down_proj = self.param("down_proj", init, (e, f, d), self.dtype)
        return routed_experts(x, gate_proj, up_proj, down_proj, weights, expert_ids, self.method)


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

    @nn.compact
    def __call__(self, x):
        assert 1 <= self.top_k <= self.num_experts, (self.top_k, self.num_experts)
        flat = x.reshape(-1, x.shape[-1])
        router = nn.Dense(self.num_experts, use_bias=False, dtype=self.dtype, param_dtype=self.dtype, name="router")
        weights, expert_ids = route(router(flat), self.top_k, self.normalize_topk)
        method = self.method or expert_method()
        experts = Experts(self.num_experts, self.intermediate_size, self.dtype, method, name="experts")
        out = experts(flat, weights, expert_ids).astype(self.dtype)
        if self.shared_expert_intermediate_size:
            shared = SharedExpert(self.shared_expert_intermediate_size, self.dtype, name="shared_expert")(flat)
            gate = nn.Dense(1, use_bias=False, dtype=self.dtype, param_dtype=self.dtype, name="shared_expert_gate")
            out = out + nn.sigmoid(gate(flat)) * shared
        return out.reshape(x.shape)
