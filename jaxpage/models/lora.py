"""LoRA adapters inside the model: each projection's output plus its adapter's low-rank product, per token.

A step serves several adapters at once. Their weights sit in S device slots, zero-padded to one rank r, and each
token names its slot (-1: the base model alone). For a projection with input x [..., in]:

    y = base(x) + ((x @ A) * mask) @ B          A [in, S * r] (the slots side by side), B [S * r, out]

where mask [..., S * r] is 1 on the r columns of the token's slot, 0 elsewhere: two matrix products whatever the
adapters' mix, nothing compiled per adapter, and a token without an adapter (or a zero-padded rank) adds exact
zeros. The scaling (alpha / r, or alpha / sqrt(r) for rsLoRA) is folded into B when a slot is filled.

Weights, for the scanned layers (L layers, S slots; `in` and `out` as torch's Linear has them, heads flattened):

    {module: {"a": [L, S, in, r], "b": [L, S, r, out]}}     module in LORA_TARGETS (jaxpage.models.lora_adapter)

Under tensor parallelism each shard holds the slice of its projection: for the column-parallel q/k/v/gate/up
projections, B's `out` (as the kernel's), for the row-parallel o/down projections A's `in`, whose partial products are
summed with the base projection's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.models.batch_invariant import invariant_matmul
from jaxpage.models.lora_adapter import LORA_TARGETS, module_features


def lora_modules(config) -> tuple[str, ...]:
    """The projections a model's adapters can target: all seven; the attention's only for a mixture of experts (an
    adapter of the experts is refused when read)."""
    return LORA_TARGETS[:4] if config.is_moe else LORA_TARGETS


def empty_slots(config, num_slots: int, rank: int, dtype) -> dict:
    """Zeroed slot weights (numpy) for every module the model's adapters can target."""
    shapes = {m: module_features(config, m) for m in lora_modules(config)}
    return {
        m: {
            "a": np.zeros((config.num_layers, num_slots, i, rank), dtype),
            "b": np.zeros((config.num_layers, num_slots, rank, o), dtype),
        }
        for m, (i, o) in shapes.items()
    }


def slots_device_bytes(config, num_slots: int, rank: int, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """Bytes one device holds of the slots' weights (empty_slots) of the model `config` as it runs: under tensor
    parallelism B of q/k/v/gate/up and A of o/down split over the shards, the other factor whole on each."""
    total = 0
    for module in lora_modules(config):
        features_in, features_out = module_features(config, module)
        split_in = module in ("o_proj", "down_proj")
        per_device_in = features_in // tensor_parallel_size if split_in else features_in
        per_device_out = features_out if split_in else features_out // tensor_parallel_size
        total += config.num_layers * num_slots * rank * (per_device_in + per_device_out)
    return total * dtype_bytes


def adapter_slot(adapter, config, rank: int, dtype) -> dict:
    """One adapter (jaxpage.models.lora_adapter.LoRAAdapter: a [L, in, r'], b [L, r', out] with its scaling in b) as
    one slot's weights {module: {"a": [L, in, rank], "b": [L, rank, out]}}, zero-padded to `rank`, for the model
    `config` as it runs (its KV heads copied under tensor parallelism: see with_kv_head_copies); modules it does not
    target are zeros."""
    if adapter.rank > rank:
        raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, more than the slots' {rank}")
    slot = {}
    for module in lora_modules(config):
        i, o = module_features(config, module)
        a = np.zeros((config.num_layers, i, rank), dtype)
        b = np.zeros((config.num_layers, rank, o), dtype)
        if module in adapter.weights:
            a_in, b_in = adapter.weights[module]
            a[:, :, : adapter.rank], b[:, : adapter.rank, :] = a_in, with_kv_head_copies(b_in, o, config.head_dim)
        slot[module] = {"a": a, "b": b}
    return slot


def with_kv_head_copies(b: np.ndarray, features_out: int, head_dim: int) -> np.ndarray:
    """B [L, r, out] of a K/V projection with each head's columns repeated until it has `features_out`: the model as
    tensor parallelism runs it when there are fewer KV heads than shards (jaxpage.worker.parallel, each KV head copied
    to the shards that read it); unchanged otherwise."""
    if b.shape[-1] == features_out:
        return b
    layers, rank, features = b.shape
    heads = b.reshape(layers, rank, features // head_dim, head_dim)
    return np.repeat(heads, features_out // features, axis=2).reshape(layers, rank, features_out)


def stack_slots(slots: list[dict | None], config, rank: int, dtype) -> dict:
    """Slot weights (see the module docstring) of S slots, each an adapter_slot or None (zeros)."""
    weights = empty_slots(config, len(slots), rank, dtype)
    for s, slot in enumerate(slots):
        for module, factors in (slot or {}).items():
            for factor, w in factors.items():
                weights[module][factor][:, s] = w
    return weights


def slot_mask(slots: jax.Array, num_slots: int, rank: int, dtype) -> jax.Array:
    """[..., S * r] ones on the rank columns of each token's slot (slots [...] int32, -1: none)."""
    one_hot = (slots[..., None] == jnp.arange(num_slots, dtype=slots.dtype)).astype(dtype)  # [..., S]
    return jnp.repeat(one_hot, rank, axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRAInputs:
    """What the model takes for LoRA: the slots' weights and each token's slot."""

    weights: dict  # {module: {"a": [L, S, in, r], "b": [L, S, r, out]}}
    slots: jax.Array  # [...] int32, the token axes of the model's input: each token's slot, -1 for none

    def mask(self, dtype) -> jax.Array:
        _, num_slots, _, rank = next(iter(self.weights.values()))["a"].shape
        return slot_mask(self.slots, num_slots, rank, dtype)


# Inside a layer: (this layer's {module: {"a": [S, in, r], "b": [S, r, out]}}, the tokens' slot mask, whether the
# model is batch-invariant), or None.
LayerLoRA = tuple[dict, jax.Array, bool] | None


def lora_of(lora: LayerLoRA, module: str) -> tuple:
    """(weights, mask, batch_invariant) of one projection for add_lora: (None, None, False) when no adapter can target
    it."""
    if lora is None or module not in lora[0]:
        return None, None, False
    return lora[0][module], lora[1], lora[2]


def add_lora(
    y: jax.Array, x: jax.Array, weights: dict | None, mask: jax.Array | None, batch_invariant: bool = False
) -> jax.Array:
    """y (a projection's output [..., *out]) plus the tokens' adapters' products of its input x [..., *in]; weights:
    this layer's {"a": [S, in, r], "b": [S, r, out]} of the projection, or None (no adapter targets it, or no LoRA);
    batch_invariant: the products in fixed row tiles (jaxpage.models.batch_invariant)."""
    if weights is None or mask is None:
        return y
    a, b = weights["a"], weights["b"]
    num_slots, features_in, rank = a.shape
    tokens = mask.shape[:-1]
    x = x.reshape(*tokens, features_in)
    a = a.transpose(1, 0, 2).reshape(features_in, num_slots * rank).astype(x.dtype)
    b = b.reshape(num_slots * rank, b.shape[-1]).astype(x.dtype)
    matmul = invariant_matmul if batch_invariant else jnp.matmul
    delta = matmul(matmul(x, a) * mask.astype(x.dtype), b)
    return y + delta.reshape(y.shape).astype(y.dtype)


def split_lora(params: dict, slots: jax.Array | None) -> tuple[dict, LoRAInputs | None]:
    """(the model's parameters, the LoRA inputs) of parameters that may hold the adapters' slots under "lora" (as
    jaxpage.worker.model_runner keeps them) and the tokens' slots (None: LoRA is off)."""
    if "lora" not in params:
        return params, None
    return {k: v for k, v in params.items() if k != "lora"}, LoRAInputs(params["lora"], slots)
