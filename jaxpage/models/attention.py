"""The attention interface the model layers call, and its cache-free dense implementation.

The model is written once; what attention does with K/V is pluggable. An attention implementation is
a hashable callable (it is part of the jitted function's static structure), the composition of `store` (K/V into
the cache) and `attend`:

    out, kv_cache = attention(q, k, v, batch, kv_cache, layer)

    q:        [..., num_heads, head_dim]      (RoPE applied)
    k, v:     [..., num_kv_heads, head_dim]   (RoPE applied to k)
    batch:    the step's metadata pytree, passed unchanged from the model's caller
    kv_cache: whatever cache state the implementation threads through the layers (None for dense)
    layer:    int32 scalar, the index of the calling layer
    out:      [..., num_heads, head_dim]

The dense implementation below serves cache-free forwards over padded `[batch, seq]` inputs, the packed one
cache-free forwards over many sequences laid end to end in one `[tokens]` axis (pooling models: encoders attend both
ways, decoder embedders causally); the paged implementation writes K/V into the page pool and attends through block
tables.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp


class Attention(Protocol):
    def __call__(self, q, k, v, batch, kv_cache, layer) -> tuple[jax.Array, object]:
        """store, then attend."""

    def store(self, k, v, batch, kv_cache, layer) -> object:
        """kv_cache with the step's K/V in it."""

    def attend(self, q, k, v, batch, kv_cache, layer) -> jax.Array:
        """out, from a kv_cache that `store` has written (a layer may choose between attentions after storing once:
        see jaxpage.models.llama.layer_attention)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseBatch:
    """Metadata of a padded batch for the cache-free path."""

    positions: jax.Array  # [batch, seq] int32, position of each token in its own sequence
    valid: jax.Array  # [batch, seq] bool, False on padding tokens


@dataclasses.dataclass(frozen=True)
class DenseAttention:
    """Causal self-attention within each row of a padded batch; no cache.

    Padding keys are never attended to; a query sees the keys at or before it in its row (and, with a
    sliding window, only the last `sliding_window` of them). GQA: each K/V head serves
    num_heads // num_kv_heads query heads. Softmax runs in float32.
    """

    sm_scale: float
    sliding_window: int | None = None
    soft_cap: float | None = None  # logits become soft_cap * tanh(logits / soft_cap) (Gemma 2)

    def __call__(self, q, k, v, batch: DenseBatch, kv_cache, layer):
        return self.attend(q, k, v, batch, kv_cache, layer), kv_cache

    def store(self, k, v, batch: DenseBatch, kv_cache, layer):
        return kv_cache  # no cache

    def attend(self, q, k, v, batch: DenseBatch, kv_cache, layer):
        # q [B, S, Hq, D]; k, v [B, S, Hkv, D]
        b, s, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[2]
        q = q.reshape(b, s, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * self.sm_scale
        if self.soft_cap is not None:
            scores = jnp.tanh(scores / self.soft_cap) * self.soft_cap
        index = jnp.arange(s)
        visible = (index[None, :] <= index[:, None])[None] & batch.valid[:, None, :]  # [B, Sq, Sk]
        if self.sliding_window is not None:
            distance = batch.positions[:, :, None] - batch.positions[:, None, :]
            visible &= distance < self.sliding_window
        visible = visible[:, None, None]  # [B, 1, 1, Sq, Sk]
        scores = jnp.where(visible, scores, -jnp.inf)
        # A padding query may see no key at all: give it zeros, not NaN.
        probs = jnp.where(visible, jax.nn.softmax(jnp.where(visible.any(-1, keepdims=True), scores, 0.0)), 0.0)
        out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return out.reshape(b, s, num_heads, head_dim).astype(q.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Metadata of sequences packed end to end, without padding between them, for the cache-free packed path."""

    positions: jax.Array  # [tokens] int32, position of each token in its own sequence
    segment_ids: jax.Array  # [tokens] int32, the sequence each token belongs to (0, 1, ...); -1 on padding
    # Static: the tokens lie in rows of this many (jaxpage.worker.packed_steps), each sequence whole in one row, so
    # attention runs within each row; None: one row of all the tokens.
    row_length: int | None = dataclasses.field(default=None, metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class PackedAttention:
    """Self-attention within each sequence of a packed batch; no cache.

    A token sees the keys of its own sequence only: all of them (`causal=False`: encoders) or those at or before its
    position (`causal=True`: decoders), with a sliding window only the last `sliding_window` of those. Padding keys are
    never seen and padding queries get zeros. GQA as DenseAttention; softmax in float32.
    """

    sm_scale: float
    causal: bool = False
    sliding_window: int | None = None
    soft_cap: float | None = None

    def __call__(self, q, k, v, batch: PackedBatch, kv_cache, layer):
        return self.attend(q, k, v, batch, kv_cache, layer), kv_cache

    def store(self, k, v, batch: PackedBatch, kv_cache, layer):
        return kv_cache  # no cache

    def attend(self, q, k, v, batch: PackedBatch, kv_cache, layer):
        # q [T, Hq, D]; k, v [T, Hkv, D], in R rows of L tokens (one row of T without batch.row_length)
        t, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        length = batch.row_length or t
        rows = t // length
        q = q.reshape(rows, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
        k, v = (x.reshape(rows, length, num_kv_heads, head_dim) for x in (k, v))
        scores = jnp.einsum("rqhgd,rkhd->rhgqk", q, k, preferred_element_type=jnp.float32) * self.sm_scale
        if self.soft_cap is not None:
            scores = jnp.tanh(scores / self.soft_cap) * self.soft_cap
        segments, positions = (x.reshape(rows, length) for x in (batch.segment_ids, batch.positions))
        visible = (segments[:, :, None] == segments[:, None, :]) & (segments[:, None, :] >= 0)  # [R, Lq, Lk]
        distance = positions[:, :, None] - positions[:, None, :]
        if self.causal:
            visible &= distance >= 0
        if self.sliding_window is not None:
            visible &= distance < self.sliding_window
        visible = visible[:, None, None]  # [R, 1, 1, Lq, Lk]
        scores = jnp.where(visible, scores, -jnp.inf)
        probs = jnp.where(visible, jax.nn.softmax(jnp.where(visible.any(-1, keepdims=True), scores, 0.0)), 0.0)
        out = jnp.einsum("rhgqk,rkhd->rqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return out.reshape(t, num_heads, head_dim).astype(q.dtype)
