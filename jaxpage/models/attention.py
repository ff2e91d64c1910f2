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


# A CPU computes a packed step's attention a few rows at a time, so that each pass's float32 scores (rows x heads x
# row_length^2; 16 MiB here) stay in cache: scores are `head_dim` products per element, so one pass over all of a
# step's rows is bound by writing and re-reading them from memory (all-MiniLM's 2,048-token step in rows of 512: 67 ms
# a layer at once, 26 ms in passes of 16 MiB; rows of 64: 6.8 -> 4.2 ms, the heads-major layout alone).
CPU_SCORES_PER_PASS = 1 << 22
# Causal attention over rows of at least 16 * CAUSAL_BLOCKS tokens runs the row's queries in this many blocks.
CAUSAL_BLOCKS = 4


def scores_per_pass(platform: str | None = None) -> int | None:
    """PackedAttention's `scores_per_pass` on `platform` (default: jax's default backend): a chip's memory keeps
    up with one pass over every row."""
    return CPU_SCORES_PER_PASS if (platform or jax.default_backend()) == "cpu" else None


@dataclasses.dataclass(frozen=True)
class PackedAttention:
    """Self-attention within each sequence of a packed batch; no cache.

    A token sees the keys of its own sequence only: all of them (`causal=False`: encoders) or those at or before its
    position (`causal=True`: decoders), with a sliding window only the last `sliding_window` of those. Padding keys are
    never seen and padding queries get zeros. GQA as DenseAttention; softmax in float32. The rows of a PackedBatch
    attend in passes of at most `scores_per_pass` scores (None: all rows in one pass; see CPU_SCORES_PER_PASS).
    """

    sm_scale: float
    causal: bool = False
    sliding_window: int | None = None
    soft_cap: float | None = None
    scores_per_pass: int | None = None

    def __call__(self, q, k, v, batch: PackedBatch, kv_cache, layer):
        return self.attend(q, k, v, batch, kv_cache, layer), kv_cache

    def store(self, k, v, batch: PackedBatch, kv_cache, layer):
        return kv_cache  # no cache

    def attend(self, q, k, v, batch: PackedBatch, kv_cache, layer):
        # q [T, Hq, D]; k, v [T, Hkv, D], in R rows of L tokens (one row of T without batch.row_length)
        t, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        length = batch.row_length or t
        rows = t // length
        # Heads-major: each (row, KV head) one matrix product: q [R, Hkv, G, L, D], k and v [R, Hkv, L, D].
        q = q.reshape(rows, length, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
        k, v = (x.reshape(rows, length, num_kv_heads, head_dim).transpose(0, 2, 1, 3) for x in (k, v))
        segments, positions = (x.reshape(rows, length) for x in (batch.segment_ids, batch.positions))
        rows_a_pass = rows
        if self.scores_per_pass is not None:
            rows_a_pass = min(rows, max(1, self.scores_per_pass // (num_heads * length**2)))
            while rows % rows_a_pass:  # a step's rows are a power of two: this leaves a power of two
                rows_a_pass -= 1
        parts = (q, k, v, segments, positions)
        if rows_a_pass == rows:
            out = self._attend_rows(*parts)
        else:
            chunks = tuple(x.reshape(rows // rows_a_pass, rows_a_pass, *x.shape[1:]) for x in parts)
            out = jax.lax.map(lambda chunk: self._attend_rows(*chunk), chunks)
        out = out.reshape(rows, num_kv_heads, group, length, head_dim).transpose(0, 3, 1, 2, 4)
        out = jnp.where(batch.segment_ids[:, None, None] >= 0, out.reshape(t, num_heads, head_dim), 0)
        return out.astype(q.dtype)

    def _attend_rows(self, q, k, v, segments, positions):
        # q [r, Hkv, G, L, D]; k, v [r, Hkv, L, D]; segments, positions [r, L] -> [r, Hkv, G, L, D] float32
        length = k.shape[2]
        if not self.causal or length < CAUSAL_BLOCKS * 16 or length % CAUSAL_BLOCKS:
            return self._attend_block(q, k, v, segments, positions, segments, positions)
        # Causal: a row's sequences lie in it in order, so a query sees no key after it in the row. The queries in
        # blocks, each against the keys up to its end: 5/8 of the row's (query, key) pairs with 4 blocks, not all.
        outs = []
        for block in range(CAUSAL_BLOCKS):
            start, end = block * length // CAUSAL_BLOCKS, (block + 1) * length // CAUSAL_BLOCKS
            queries, keys = slice(start, end), slice(None, end)  # positions in the row
            outs.append(
                self._attend_block(
                    q[:, :, :, queries],
                    k[:, :, keys],
                    v[:, :, keys],
                    segments[:, queries],
                    positions[:, queries],
                    segments[:, keys],
                    positions[:, keys],
                )
            )
        return jnp.concatenate(outs, axis=3)

    def _attend_block(self, q, k, v, query_segments, query_positions, key_segments, key_positions):
        # q [r, Hkv, G, Lq, D]; k, v [r, Hkv, Lk, D]; query_* [r, Lq], key_* [r, Lk] -> [r, Hkv, G, Lq, D] float32
        scores = jnp.einsum("rhgqd,rhkd->rhgqk", q, k, preferred_element_type=jnp.float32) * self.sm_scale
        if self.soft_cap is not None:
            scores = jnp.tanh(scores / self.soft_cap) * self.soft_cap
        visible = (query_segments[:, :, None] == key_segments[:, None, :]) & (key_segments[:, None, :] >= 0)
        distance = query_positions[:, :, None] - key_positions[:, None, :]  # [r, Lq, Lk]
        if self.causal:
            visible &= distance >= 0
        if self.sliding_window is not None:
            visible &= distance < self.sliding_window
        # Finite, not -inf: a padding query (no key visible) then averages its row's values instead of making NaNs,
        # and its output is zeroed after.
        scores = scores + jnp.where(visible, 0.0, -1e30)[:, None, None]
        probs = jnp.exp(scores - scores.max(-1, keepdims=True))
        total = probs.sum(-1, keepdims=True)
        return jnp.einsum("rhgqk,rhkd->rhgqd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32) / total
