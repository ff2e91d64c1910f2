"""The draft model of speculative decoding on the device: its pool (the target's pages), caught
up on the tokens the target computed since its last draft, then k tokens proposed in one program.

A DraftModelRunner is a ModelRunner (the same forward pass, pool, compilation cache, devices and multi-host
broadcast) that also proposes. It never writes a Sequence: `propose` says how many tokens of each sequence its pool
holds after the step, and the scheduler records it (Scheduler.update_from_output).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpage.attention import PagedBatch
from jaxpage.kv_cache import KVCache
from jaxpage.models.llama import Llama
from jaxpage.sample.rejection_sampler import target_probs
from jaxpage.sample.sampler import SamplingMetadata, draw
from jaxpage.sequence import ScheduledSequence, SchedulerOutput
from jaxpage.worker.compilation_cache import CompiledShape
from jaxpage.worker.model_runner import ModelRunner, fetch
from jaxpage.worker.parallel import REPLICAS
from jaxpage.worker.step_broadcast import Header, Message, unpack
from jaxpage.worker.step_inputs import row_sampling
from jaxpage.worker.step_shapes import StepShape

DRAFT_SEED_SALT = np.uint32(
    0x9E3779B9
)  # a draft model samples with the uniforms of (seed ^ this, step): its own stream


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProposeInput:
    """A draft model's proposal for the rows of a verify step: from each row's last known token, k tokens."""

    token_ids: jax.Array  # [R] int32: each row's last known token
    positions: jax.Array  # [R] int32: its position
    block_tables: jax.Array  # [R, P] int32
    num_slots: jax.Array  # [R] int32: slots the step reserved from that position on (1 + the row's draft length)
    sampling: SamplingMetadata  # [R] rows; steps = tokens generated before this step


class DraftModelRunner(ModelRunner):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.proposers: dict[StepShape, jax.stages.Compiled] = {}  # the proposal, by verify shape
        self._propose = jax.jit(self._propose_fn, donate_argnums=(1,), static_argnums=(3,))

    @property
    def num_compilations(self) -> int:
        return super().num_compilations + len(self.proposers)

    def _propose_fn(self, params, kv_cache: KVCache, inputs: ProposeInput, k: int):
        """(draft tokens [R, k], their distributions [R, k, V] float32, kv_cache with the K/V of each row's last
        token and first k - 1 draft tokens): k decode steps of this (draft) model, each sampling the next token
        from its own distribution after the row's sampling settings. Positions past a row's reserved slots write
        into the null page."""
        pool = self.pool.specs
        propose = functools.partial(self._propose_on_shard, k=k)
        return self._on_shards(propose, (pool, REPLICAS), (REPLICAS, REPLICAS, pool))(params, kv_cache, inputs)

    def _propose_on_shard(self, params, kv_cache: KVCache, inputs: ProposeInput, k: int):
        rows = inputs.token_ids.shape[0]
        page_size = self.page_size
        model = self.models[1]

        def draft_step(carry, j):
            kv_cache, tokens = carry
            positions = inputs.positions + j
            reserved = j < inputs.num_slots
            page_index = jnp.minimum(positions // page_size, inputs.block_tables.shape[1] - 1)
            pages = jnp.take_along_axis(inputs.block_tables, page_index[:, None], axis=1)[:, 0]
            slots = jnp.where(reserved, pages * page_size + positions % page_size, 0)
            batch = PagedBatch(
                slots,
                inputs.block_tables,
                jnp.where(reserved, positions + 1, 0),
                jnp.arange(rows + 1, dtype=jnp.int32),
                jnp.int32(rows),
            )
            hidden, kv_cache = model.apply({"params": params}, tokens, positions, batch, kv_cache)
            logits = model.apply({"params": params}, hidden, method=Llama.logits)
            sampling = dataclasses.replace(inputs.sampling, steps=inputs.sampling.steps + j)
            probs = target_probs(logits, sampling)
            # Their own random stream: draft tokens must not depend on the verifier's uniforms.
            next_tokens = draw(probs, dataclasses.replace(sampling, seeds=sampling.seeds ^ DRAFT_SEED_SALT))
            return (kv_cache, next_tokens), (next_tokens, probs)

        (kv_cache, _), (tokens, probs) = lax.scan(draft_step, (kv_cache, inputs.token_ids), jnp.arange(k))
        return tokens.T, jnp.swapaxes(probs, 0, 1), kv_cache

    def compile_proposer(self, shape: StepShape) -> jax.stages.Compiled:
        """A draft model's proposal for `shape`'s rows and k, as `compile` gets the forward pass."""
        args = (self.params, self.kv_cache, self._abstract(self.inputs.stacked([self._propose_input([], shape)])))
        k = shape.num_draft_positions
        options = self.compiler_options  # ModelRunner.compiler_options
        executable = self._load_or_compile(
            CompiledShape("propose", (shape.num_rows, k)), args, lambda: self._propose.lower(*args, k).compile(options)
        )
        self.proposers[shape] = executable
        return executable

    def _propose_input(self, items: list, shape: StepShape) -> ProposeInput:
        rows = shape.num_rows
        token_ids, positions, num_slots = (np.zeros(rows, np.int32) for _ in range(3))
        block_tables = np.zeros((rows, self.inputs.block_table_width), np.int32)
        for row, item in enumerate(items):
            seq, position = item.seq, item.num_computed_tokens + item.num_new_tokens - len(item.draft_token_ids) - 1
            token_ids[row], positions[row] = seq.token_ids[position], position
            num_slots[row] = 1 + len(item.draft_token_ids)
            block_tables[row, : len(seq.block_table)] = seq.block_table
        return ProposeInput(token_ids, positions, block_tables, num_slots, row_sampling(items, rows))

    def propose(self, output: SchedulerOutput) -> tuple[SchedulerOutput, jax.Array, dict[int, int]]:
        """The drafts for the verify step `output`, whose items hold placeholder drafts of the length each may
        draft (their slots reserved): (output with the drafts, their distributions [R, k, V] on the device, for the
        target's verification, and by seq_id the tokens whose K/V this pool then holds)."""
        shape = self.inputs.shape_for(output)
        assert shape.kind == "verify", shape
        inputs = self.inputs.stacked([self._propose_input(output.scheduled, shape)])
        tokens, probs = self._launch(Message.PROPOSE, shape, inputs)
        tokens = fetch(tokens)
        if self.mesh is not None:  # one replica (speculative decoding runs without data parallelism)
            tokens = tokens[0]
        k = shape.num_draft_positions
        # K/V written: the last token's and the first k - 1 drafts' (when reserved)
        computed = {
            item.seq.seq_id: item.num_computed_tokens + min(k, 1 + len(item.draft_token_ids))
            for item in output.scheduled
        }
        scheduled = [
            dataclasses.replace(item, draft_token_ids=tuple(tokens[row, : len(item.draft_token_ids)].tolist()))
            for row, item in enumerate(output.scheduled)
        ]
        return dataclasses.replace(output, scheduled=scheduled), probs, computed

    def _run_propose(self, shape: StepShape, inputs: ProposeInput) -> tuple[jax.Array, jax.Array]:
        proposer = self._proposer_program(shape)
        tokens, probs, self.kv_cache = proposer(self.params, self.kv_cache, inputs)
        return tokens, probs

    def catch_up(self, output: SchedulerOutput) -> None:
        """The pool brought up to the verify step `output` before `propose`: each sequence's tokens before its last
        one whose K/V this pool lacks (from seq.num_draft_computed_tokens) run through this model's
        forward pass, in as few steps of its shapes as hold them (decode shapes when each lacks one token: after a
        fully accepted draft, the draft's last token)."""
        mixed = [s for s in self.shapes if s.kind == "mixed"]
        max_tokens, max_rows = max(s.num_tokens for s in mixed), max(s.num_rows for s in mixed)
        pending: list[ScheduledSequence] = []
        budget = max_tokens
        for item in output.scheduled:
            computed = item.seq.num_draft_computed_tokens
            while computed < item.num_computed_tokens:
                n = min(item.num_computed_tokens - computed, budget)
                pending.append(ScheduledSequence(item.seq, computed, n))
                computed += n
                budget -= n
                if budget == 0 or len(pending) == max_rows:
                    self._forward_only(pending)
                    pending, budget = [], max_tokens
        if pending:
            self._forward_only(pending)

    def _forward_only(self, items: list[ScheduledSequence]) -> None:
        """The forward pass alone of a step of `items` (their K/V into this model's pool; no sampling)."""
        output = SchedulerOutput(scheduled=items, page_copies=[])
        shape = self.inputs.shape_for(output)
        step, _ = self.inputs.prepare(output, shape)
        self._launch(Message.FORWARD, shape, self.inputs.stacked([step]))

    def _proposer_program(self, shape: StepShape) -> jax.stages.Compiled:
        return self.proposers.get(shape) or self.compile_proposer(shape)

    def warmup_programs(self) -> list[tuple[CompiledShape, Callable[[], jax.stages.Compiled]]]:
        """A draft model's warm-up: the pool's fill, the forward pass of every step shape and the proposal of every
        verify shape (a draft model samples only in its proposals)."""
        programs = [self._pool_warmup()]
        for shape in self.shapes:
            programs.append((CompiledShape("forward", shape), functools.partial(self._forward_program, shape)))
            if shape.kind == "verify":
                what = CompiledShape("propose", (shape.num_rows, shape.num_draft_positions))
                programs.append((what, functools.partial(self._proposer_program, shape)))
        return programs

    def run(self, kind: Message, key: int, payload, flag: int = 0, draft_probs=None):
        """ModelRunner.run, and PROPOSE: (draft tokens, their distributions), on the device."""
        if kind is Message.PROPOSE:
            return self._run_propose(self.shapes[key], payload)
        return super().run(kind, key, payload, flag, draft_probs)

    def unpack(self, header: Header, data: bytes):
        if header.kind is Message.PROPOSE:
            return unpack(data, self.inputs.stacked([self._propose_input([], self.shapes[header.key])]))
        return super().unpack(header, data)

    def payload_sizes(self) -> set[int]:
        sizes = super().payload_sizes()
        for shape in self.shapes:
            if shape.kind == "verify":
                inputs = self.inputs.stacked([self._propose_input([], shape)])
                sizes.add(sum(np.asarray(x).nbytes for x in jax.tree.leaves(inputs)))
        return sizes
