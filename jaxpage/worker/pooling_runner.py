"""The device side of a pooling model: a packed step (jaxpage.worker.packed_steps.PackedStep) through the model and
its pooler, one compiled program per token bucket, one vector per input back to the host."""

from __future__ import annotations

import functools
import logging
import time

import jax
import numpy as np

from jaxpage.models.attention import PackedBatch
from jaxpage.models.pooling_model import PoolingModel
from jaxpage.pooling.poolers import pool
from jaxpage.worker.packed_steps import PackedStep

logger = logging.getLogger("jaxpage")


def _pooled(
    model: PoolingModel, pooling_type: str, params, token_ids, token_types, positions, segments, starts, lengths, *,
    row_length: int,
):  # fmt: skip
    batch = PackedBatch(positions, segments, row_length)
    hidden = model.forward(params, token_ids, positions, batch, token_types)
    if model.classify is not None:  # a classification head reads each input's first token
        return model.classify(params, hidden, starts)
    return pool(pooling_type, hidden, segments, starts, lengths)


class PoolingRunner:
    """Runs packed steps of `model` pooled by `pooling_type` (jaxpage.config.pooler.POOLING_TYPES), or through its
    classification head where it has one. A step's program is compiled at its first use, one per (tokens, input
    slots, row length)."""

    def __init__(self, model: PoolingModel, pooling_type: str):
        self.model = model
        self._program = jax.jit(functools.partial(_pooled, model, pooling_type), static_argnames=("row_length",))
        self._executables: dict[tuple[int, int, int], object] = {}
        self.compile_seconds: dict[tuple[int, int, int], float] = {}  # (tokens, slots, row length) of each compiled

    def lower(self, num_tokens: int, num_slots: int, row_length: int, sharding=None):
        """The program of a step of num_tokens tokens in rows of row_length and num_slots inputs, lowered for the
        parameters as they are (arrays, or placed ShapeDtypeStructs: jaxpage.aot compiles it for a chip this host
        does not have)."""
        tokens, slots = (jax.ShapeDtypeStruct((n,), np.int32, sharding=sharding) for n in (num_tokens, num_slots))
        return self._program.lower(
            self.model.params, tokens, tokens, tokens, tokens, slots, slots, row_length=row_length
        )

    def run(self, step: PackedStep) -> np.ndarray:
        """[step.num_inputs, hidden_size] float32: each input's pooled hidden state (not normalized); a classifier's
        [step.num_inputs, num_labels] float32 logits."""
        arrays = (step.token_ids, step.token_type_ids, step.positions, step.segment_ids, step.starts, step.lengths)
        shape = (len(step.token_ids), len(step.starts), step.row_length)
        executable = self._executables.get(shape)
        if executable is None:
            start = time.perf_counter()
            lowered = self._program.lower(self.model.params, *arrays, row_length=step.row_length)
            executable = self._executables[shape] = lowered.compile()
            self.compile_seconds[shape] = time.perf_counter() - start
            logger.info(
                "pooling step of %d tokens (rows of %d), %d inputs: compiled in %.2fs",
                shape[0], shape[2], shape[1], self.compile_seconds[shape],
            )  # fmt: skip
        return np.asarray(executable(self.model.params, *arrays))[: step.num_inputs]
