"""The pooling types (jaxpage.config.pooler.POOLING_TYPES) over a packed step's hidden states, in float32.

A packed step lays its inputs end to end in one token axis (jaxpage.models.attention.PackedBatch); input i holds the
tokens [starts[i], starts[i] + lengths[i]). Rows past the step's inputs have length 0 and give zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pool(pooling_type: str, hidden, segment_ids, starts, lengths):
    """One vector per input: [rows, hidden_size] float32.

    hidden:      [tokens, hidden_size]  the model's last hidden states
    segment_ids: [tokens] int32         the input each token belongs to; -1 on padding
    starts:      [rows] int32           each input's first token
    lengths:     [rows] int32           each input's token count (0 on padding rows)
    """
    hidden = hidden.astype(jnp.float32)
    rows = starts.shape[0]
    real = (lengths > 0)[:, None]
    if pooling_type == "CLS":
        return jnp.where(real, hidden[starts], 0.0)
    if pooling_type == "LAST":
        return jnp.where(real, hidden[jnp.maximum(starts + lengths - 1, 0)], 0.0)
    segments = jnp.where(segment_ids >= 0, segment_ids, rows)  # padding tokens: a segment past the last, dropped
    if pooling_type == "MEAN":
        sums = jax.ops.segment_sum(hidden, segments, num_segments=rows)
        return sums / jnp.maximum(lengths, 1)[:, None].astype(jnp.float32)
    if pooling_type == "MAX":
        return jnp.where(real, jax.ops.segment_max(hidden, segments, num_segments=rows), 0.0)
    raise ValueError(f"unknown pooling type {pooling_type!r}")
