"""Turns a scheduled step into arrays, runs its two compiled programs on the device, returns sampled tokens.

A step is two programs, dispatched back to back: the forward pass (the model over the step's tokens, writing
their K/V into the pool) and the sampler (the LM head over the rows that sample, sampling, log-probs). The full
logits never leave the sampler; only token ids (and log-probs when asked) come back to the host.

Every step is padded to one of a few shapes (jaxpage.step_shapes), each compiled once. Block tables have one width,
ceil(max_model_len / page_size) pages: attention reads each table only up to its sequence's kv length, so a wider
table costs a few bytes, not time.
`warmup()` compiles every shape; after it, no workload compiles anything new. With the persistent compilation
cache (on by default, see jaxpage.compilation_cache) a later process loads them instead: no tracing, no compiling.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpage.attention import AttentionBackend, PagedAttention, PagedBatch
from jaxpage.compilation_cache import CompilationCache, program_key
from jaxpage.config import ModelConfig
from jaxpage.kv_cache import KVCache, copy_pages
from jaxpage.models.llama import Llama, build, params_dtype
from jaxpage.parallel import DATA_AXIS, TP_AXIS, local_params, param_specs, shard_config
from jaxpage.sampler import SamplingMetadata, sample, sampled_logprobs, sampling_metadata_from_params
from jaxpage.sampling_params import SamplingParams
from jaxpage.scheduler import SchedulerOutput
from jaxpage.spec_decode.verification import verify_drafts
from jaxpage.step_broadcast import Header, Message, StepBroadcast, unpack
from jaxpage.step_shapes import StepShape, step_shapes

logger = logging.getLogger("jaxpage")

REPLICAS = P(DATA_AXIS)  # the spec of arrays stacked over the data-parallel replicas: one each
POOL_BYTES_TOLERANCE = 0.02  # how far the compiled pool's bytes may stray from the budget arithmetic's
COPY_CHUNK = 8  # copy-on-write page copies per call of the (one) compiled copy program
MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS  # top logprobs a step returns when some row asks for logprobs


def fetch(x: jax.Array) -> np.ndarray:
    """A result on the host. One that spans the devices of several processes is whole on each device (gathered or
    replicated): this process reads its own copy."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


def row_sampling(items: list, num_rows: int) -> SamplingMetadata:
    """The sampling settings of the scheduled items, a row each (greedy for an item that does not sample this step),
    padded to num_rows."""
    return sampling_metadata_from_params(
        [item.seq.sampling_params if item.samples else None for item in items],
        steps=[len(item.seq.output_token_ids) for item in items],
        seeds=[item.seq.seed for item in items],
        num_rows=num_rows,
    )


@dataclasses.dataclass(frozen=True)
class CompiledShape:
    program: str  # "forward" (the model, for a StepShape), "sample" (LM head and sampler, for R rows), "verify"
    # (LM head and verification, for (R rows, k draft tokens)), "pool", "copy"
    shape: StepShape | int | tuple
    seconds: float = 0.0  # lowering and compiling (or loading from a cache)
    loaded: bool = False  # from the compilation cache: neither traced, lowered nor compiled

    def __str__(self) -> str:
        shape = self.shape
        if self.program == "sample":
            shape = f"rows={self.shape}"
        elif self.program in ("verify", "propose"):
            shape = "rows={}, k={}".format(*self.shape)
        return f"{self.program} {shape}: {'loaded' if self.loaded else 'compiled'} in {self.seconds:.2f}s"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    token_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    attention: PagedBatch
    logits_indices: jax.Array  # [R * (k + 1)] int32, the tokens whose logits each sampler row uses (k: see SampleInput)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleInput:
    sampling: SamplingMetadata  # [R] rows
    want_logprobs: jax.Array  # [] bool: some row asks for logprobs (else they are not computed)
    draft_tokens: jax.Array  # [R, k] int32: each row's draft tokens (k = 0: a plain step, one token per row)
    num_drafts: jax.Array  # [R] int32 in [0, k]: how many of its k are real
    draft_probs: jax.Array | None = None  # [R, k, V] float32 the draft model's distributions; None: point masses


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """Per scheduled item (meaningful where it samples): its accepted draft tokens, then the token sampled after
    them (plain steps: k = 0, the sampled token alone)."""

    token_ids: np.ndarray  # [num scheduled, k + 1] int32; -1 after the item's num_accepted + 1 tokens
    num_accepted: np.ndarray  # [num scheduled] int32: draft tokens accepted (0 in plain steps)
    logprobs: np.ndarray | None  # [num scheduled, k + 1] float32, log-prob of each token; None unless asked
    top_logprob_ids: np.ndarray | None  # [num scheduled, k + 1, min(MAX_LOGPROBS, vocab)] int32
    top_logprobs: np.ndarray | None  # [num scheduled, k + 1, min(MAX_LOGPROBS, vocab)] float32
    shape: StepShape  # what the step was padded to
    prepare_s: float = 0.0  # host: building the step's arrays
    device_s: float = 0.0  # dispatch until the sampled tokens are back on the host


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        params: dict,
        backend: AttentionBackend,
        *,
        num_pages: int,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        compilation_cache: CompilationCache | None = None,
        num_speculative_tokens: int = 0,
        max_verify_rows: int = 0,
        draft_probs: bool = False,
        mesh: jax.sharding.Mesh | None = None,
        channel: StepBroadcast | None = None,
        channel_runner: int = 0,
        compile_only: bool = False,
    ):
        self.config = config  # the whole model's (with_replicated_kv_heads under tensor parallelism)
        # Programs built for chips this host lacks (jaxpage.aot): params are ShapeDtypeStructs placed on compile-only
        # devices, the pool is one too, and nothing runs.
        self.compile_only = compile_only
        self.compilation_cache = compilation_cache
        self.params = params
        self.backend = backend
        self.dtype = dtype = params_dtype(params)  # the compute dtype
        # Several devices (jaxpage.parallel): every program runs one shard's model per device under shard_map, each
        # data-parallel replica on its own step (the step's arrays stacked over the replicas) and its own pages.
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        self.tensor_parallel_size = 1 if self.mesh is None else self.mesh.shape[TP_AXIS]
        self.data_parallel_size = 1 if self.mesh is None else self.mesh.shape[DATA_AXIS]
        self.pages_per_replica = num_pages
        # Several hosts (jaxpage.step_broadcast): process 0 tells the others each program it launches, as runner
        # `channel_runner` (0: the target model's, 1: a draft model's); they `replay` it.
        self.channel = channel
        self.channel_runner = channel_runner
        self._gather_replicas = self.mesh is not None and self.mesh.is_multi_process
        self._param_specs = param_specs(params)
        self._pool_specs = backend.pool_specs()
        split = self.tensor_parallel_size > 1  # data parallelism alone runs the whole model on each replica
        shard = shard_config(config, self.tensor_parallel_size) if split else config
        tp_axis = TP_AXIS if split else None
        self.compile_log: list[CompiledShape] = []  # every program compiled or loaded, in order
        self._pool_layout = backend.pool_layout(
            config, num_pages * self.data_parallel_size, page_size, dtype, self.tensor_parallel_size
        )
        self._fill_pool = None  # the program that makes a zeroed pool
        self.kv_cache = self._pool_shapes() if compile_only else self._allocate_pool()
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.shapes = step_shapes(max_num_seqs, max_num_batched_tokens, num_speculative_tokens, max_verify_rows)
        self.draft_probs = draft_probs  # verify steps take the draft model's distributions (else point masses)
        self.block_table_width = math.ceil(max_model_len / page_size)
        self.models = {  # by the shapes' max_q_len
            q_len: build(
                shard,
                PagedAttention(backend, config.head_dim**-0.5, config.sliding_window, q_len or None),
                dtype,
                tp_axis,
                backend.platform,
            )
            for q_len in {0, 1} | {s.max_q_len for s in self.shapes}
        }
        self.executables: dict[StepShape, jax.stages.Compiled] = {}  # the forward pass of each step shape
        self.samplers: dict[tuple[int, int], jax.stages.Compiled] = {}  # LM head and sampler, by (rows, k)
        self._forward = jax.jit(self._forward_fn, donate_argnums=(1,), static_argnums=(3,))
        self._sample = jax.jit(self._sample_fn)
        self._copy_pages_jit = jax.jit(copy_pages, donate_argnums=(0,))
        self._copy_chunk = None  # the copy of COPY_CHUNK pages, compiled at its first use

    @property
    def num_compilations(self) -> int:
        """Programs compiled (or loaded from the persistent cache) so far: forward shapes and sampler shapes."""
        return len(self.executables) + len(self.samplers)

    # ----- device side -----

    def _on_shards(self, fn, in_specs: tuple, out_specs, gather: bool = False):
        """fn (whose first argument is the parameters) as each device runs it on several devices: its shard of the
        parameters, the pool and the arrays as `in_specs` say, under shard_map; fn itself on one device. Arrays
        stacked over the data-parallel replicas (spec REPLICAS) reach fn as the device's replica's (and its results
        under REPLICAS are stacked back). gather (for results out_specs REPLICAS): every replica's results on every
        device, so that each process can read them all."""
        if self.mesh is None:
            return fn

        def unstack(tree):
            return jax.tree.map(lambda x: x[0], tree)

        def on_shard(params, *args):
            args = [unstack(a) if spec == REPLICAS else a for a, spec in zip(args, in_specs, strict=True)]
            out = fn(local_params(params) if self.tensor_parallel_size > 1 else params, *args)
            if out_specs == REPLICAS:
                out = jax.tree.map(lambda x: x[None], out)
                return jax.tree.map(lambda x: lax.all_gather(x, DATA_AXIS, tiled=True), out) if gather else out
            return tuple(
                jax.tree.map(lambda x: x[None], o) if spec == REPLICAS else o
                for o, spec in zip(out, out_specs, strict=True)
            )

        specs = (self._param_specs, *in_specs)
        # check_vma off: the attention loops carry values that vary over the shards from initial values that do
        # not, which its check refuses; what the programs return whole (P()) is the same on every shard by
        # construction (after an all-reduce or all-gather), as the tests that compare with one device show.
        outs = P() if gather else out_specs
        return jax.shard_map(on_shard, mesh=self.mesh, in_specs=specs, out_specs=outs, check_vma=False)

    def _forward_fn(self, params, kv_cache: KVCache, step: StepInput, max_q_len: int):
        """(hidden states [R * (k + 1), hidden] of the tokens the sampler's rows use, kv_cache with the step's
        K/V)."""

        def forward(params, kv_cache, step):
            hidden, kv_cache = self.models[max_q_len].apply(
                {"params": params}, step.token_ids, step.positions, step.attention, kv_cache
            )
            return hidden[step.logits_indices], kv_cache

        pool = self._pool_specs
        return self._on_shards(forward, (pool, REPLICAS), (REPLICAS, pool))(params, kv_cache, step)

    def _sample_fn(self, params, hidden: jax.Array, inputs: SampleInput):
        sample = self._on_shards(self._sample_on_shard, (REPLICAS, REPLICAS), REPLICAS, gather=self._gather_replicas)
        return sample(params, hidden, inputs)

    def _sample_on_shard(self, params, hidden: jax.Array, inputs: SampleInput):
        """(token ids [R, k + 1], accepted draft tokens [R], (log-probs of the tokens [R, k + 1], top ids
        [R, k + 1, MAX_LOGPROBS], top log-probs)). With k = 0 each row samples one token; with k > 0 each row's
        drafts are verified (jaxpage.spec_decode.verification). The full logits never leave this function; the log-probs
        are computed only when some row asks for them."""
        logits = self.models[0].apply({"params": params}, hidden, method=Llama.logits)  # [R * (k + 1), V] float32
        rows, k = inputs.draft_tokens.shape
        if k == 0:
            token_ids = sample(logits, inputs.sampling).token_ids[:, None]
            num_accepted = jnp.zeros(rows, jnp.int32)
        else:
            logits = logits.reshape(rows, k + 1, -1)
            verified = verify_drafts(
                logits, inputs.sampling, inputs.draft_tokens, inputs.num_drafts, inputs.draft_probs
            )
            token_ids, num_accepted = verified.token_ids, verified.num_accepted
        flat_logits, flat_ids = logits.reshape(rows * (k + 1), -1), jnp.maximum(token_ids, 0).reshape(-1)
        top = min(MAX_LOGPROBS, flat_logits.shape[-1])  # a vocabulary can be smaller than MAX_LOGPROBS
        no_logprobs = (
            jnp.zeros(rows * (k + 1), jnp.float32),
            jnp.zeros((rows * (k + 1), top), jnp.int32),
            jnp.zeros((rows * (k + 1), top), jnp.float32),
        )
        logprobs = lax.cond(
            inputs.want_logprobs, lambda: sampled_logprobs(flat_logits, flat_ids, top), lambda: no_logprobs
        )
        logprobs = tuple(x.reshape(rows, k + 1, *x.shape[1:]) for x in logprobs)
        return token_ids, num_accepted, logprobs

    def compile(self, shape: StepShape) -> jax.stages.Compiled:
        """The forward pass of `shape`: from the compilation cache, else lowered and compiled (and kept there)."""
        step, _ = self._padding_input(shape)
        args = (self.params, self.kv_cache, self._abstract(step))
        executable = self._load_or_compile(
            CompiledShape("forward", shape), args, lambda: self._forward.lower(*args, shape.max_q_len).compile()
        )
        self.executables[shape] = executable
        return executable

    def compile_sampler(self, shape: StepShape) -> jax.stages.Compiled:
        """The LM head and sampler (or verification) of `shape`'s sample rows and k, as `compile` gets the forward
        pass."""
        rows, k = shape.sample_rows, shape.num_draft_positions
        _, inputs = self._padding_input(shape)
        hidden_shape = (rows * (k + 1), self.config.hidden_size)
        if self.mesh is not None:
            hidden_shape = (self.data_parallel_size, *hidden_shape)
        where = None
        if self.compile_only:  # where the forward pass leaves it
            where = self._replicated if self.mesh is None else NamedSharding(self.mesh, REPLICAS)
        hidden = jax.ShapeDtypeStruct(hidden_shape, self.dtype, sharding=where)
        args = (self.params, hidden, self._abstract(inputs))
        what = CompiledShape("verify", (rows, k)) if k else CompiledShape("sample", rows)
        executable = self._load_or_compile(what, args, lambda: self._sample.lower(*args).compile())
        self.samplers[rows, k] = executable
        return executable

    def _run_forward(self, shape: StepShape, step: StepInput) -> None:
        self._send(Message.FORWARD, shape, step)
        _, self.kv_cache = self._forward_program(shape)(self.params, self.kv_cache, step)

    def _load_or_compile(self, what: CompiledShape, args: tuple, compile_it, static=None) -> jax.stages.Compiled:
        """The program `what` from the compilation cache, else compile_it() (kept in the cache). Its key: `static`
        (default: the model config, the attention backend and what.shape) and the arguments' shapes and dtypes."""
        start = time.perf_counter()
        key = None
        if self.compilation_cache is not None:
            static = (self.config, self.backend, what.shape) if static is None else static
            static = (*static, self.tensor_parallel_size)
            if jax.process_count() > 1:  # each process compiles its own part of the program
                static = (*static, "process", jax.process_index(), jax.process_count())
            key = program_key(what.program, static, args)
            devices = [jax.devices()[0]] if self.mesh is None else list(self.mesh.devices.flat)
            executable = self.compilation_cache.load(key, devices)
            if executable is not None:
                self._log(dataclasses.replace(what, seconds=time.perf_counter() - start, loaded=True))
                return executable
        executable = compile_it()
        if key is not None:
            self.compilation_cache.store(key, executable)
        self._log(dataclasses.replace(what, seconds=time.perf_counter() - start))
        return executable

    def _log(self, compiled: CompiledShape) -> None:
        self.compile_log.append(compiled)
        logger.info("%s", compiled)

    def warmup(self) -> list[CompiledShape]:
        """Compiles every step shape and sampler shape not compiled yet (and the page copy); returns what it
        compiled."""
        return self._compile_all(self.warmup_programs())

    def _compile_all(self, programs: list) -> list[CompiledShape]:
        start = len(self.compile_log)
        for _, get in programs:
            get()
        return self.compile_log[start:]

    def warmup_programs(self) -> list[tuple[CompiledShape, Callable[[], jax.stages.Compiled]]]:
        """Every program warm-up compiles, as (what it is, a function that returns it compiled: at its first call
        compiled or loaded, later the same program), in warm-up's order: the pool's fill (compiled when the runner
        is built, unless compile_only), the forward pass of each step shape with its sampler (each sampler shape
        once), the page copy."""
        programs = [self._pool_warmup()]
        samplers = set()
        for shape in self.shapes:
            programs.append((CompiledShape("forward", shape), functools.partial(self._forward_program, shape)))
            rows, k = shape.sample_rows, shape.num_draft_positions
            if (rows, k) not in samplers:
                samplers.add((rows, k))
                what = CompiledShape("verify", (rows, k)) if k else CompiledShape("sample", rows)
                programs.append((what, functools.partial(self._sampler_program, shape)))
        programs.append((CompiledShape("copy", COPY_CHUNK), self._copy_program))
        return programs

    def _pool_warmup(self) -> tuple[CompiledShape, Callable[[], jax.stages.Compiled]]:
        return CompiledShape("pool", self._pool_layout.k.shape), self._pool_program

    def _forward_program(self, shape: StepShape) -> jax.stages.Compiled:
        return self.executables.get(shape) or self.compile(shape)

    def _sampler_program(self, shape: StepShape) -> jax.stages.Compiled:
        return self.samplers.get((shape.sample_rows, shape.num_draft_positions)) or self.compile_sampler(shape)

    # ----- host side -----

    def shape_for(self, *outputs: SchedulerOutput) -> StepShape:
        """The smallest shape of the step's kind that holds it (or each data-parallel replica's step, all padded to
        one shape): verify if some sequence brings draft tokens (the scheduler keeps those to steps without
        prefill; speculative decoding runs without data parallelism), else decode if every sequence has one new
        token, else mixed."""
        items = [item for output in outputs for item in output.scheduled]
        rows = max(len(output.scheduled) for output in outputs)
        if any(item.draft_token_ids for item in items):
            return self.smallest_shape("verify", rows)
        if all(item.num_new_tokens == 1 for item in items):
            return self.smallest_shape("decode", rows)
        return self.smallest_shape("mixed", max(output.num_batched_tokens for output in outputs))

    def smallest_shape(self, kind: str, size: int) -> StepShape:
        """The smallest shape of `kind` for `size` sequences (decode, verify) or tokens (mixed)."""
        return next(
            s for s in self.shapes if s.kind == kind and (s.num_tokens if kind == "mixed" else s.num_rows) >= size
        )

    def prepare(self, output: SchedulerOutput, shape: StepShape) -> tuple[StepInput, SampleInput]:
        """The step's arrays (numpy), padded to `shape`: the forward pass's and the sampler's (with a draft model's
        distributions, for a verify step with drafts from a draft model)."""
        items = output.scheduled
        page_size = self.page_size
        k = shape.num_draft_positions
        assert len(items) <= shape.num_rows, (len(items), shape)
        assert shape.max_q_len == 0 or all(item.num_new_tokens <= shape.max_q_len for item in items), shape
        token_ids = np.zeros(shape.num_tokens, np.int32)
        positions = np.zeros(shape.num_tokens, np.int32)
        slot_mapping = np.zeros(shape.num_tokens, np.int32)  # padding tokens write into the null page
        cu_q_lens = np.zeros(shape.num_rows + 1, np.int32)
        kv_lens = np.zeros(shape.num_rows, np.int32)
        block_tables = np.zeros((shape.num_rows, self.block_table_width), np.int32)
        logits_indices = np.zeros((shape.sample_rows, k + 1), np.int32)
        draft_tokens = np.zeros((shape.sample_rows, k), np.int32)
        num_drafts = np.zeros(shape.sample_rows, np.int32)
        start = 0
        for row, item in enumerate(items):
            seq, computed, n, drafts = item.seq, item.num_computed_tokens, item.num_new_tokens, item.draft_token_ids
            end = start + n
            known = n - len(drafts)  # the sequence's own tokens, then the drafts
            token_ids[start : start + known] = seq.token_ids[computed : computed + known]
            token_ids[start + known : end] = drafts
            pos = np.arange(computed, computed + n, dtype=np.int32)
            positions[start:end] = pos
            table = np.asarray(seq.block_table, np.int32)
            slot_mapping[start:end] = table[pos // page_size] * page_size + pos % page_size
            block_tables[row, : len(table)] = table
            kv_lens[row] = computed + n
            # The last known token's logits, then each draft token's (repeated past the row's drafts).
            logits_indices[row] = start + known - 1 + np.minimum(np.arange(k + 1), len(drafts))
            draft_tokens[row, : len(drafts)] = drafts
            num_drafts[row] = len(drafts)
            cu_q_lens[row + 1] = end
            start = end
        cu_q_lens[len(items) + 1 :] = start
        sampling = row_sampling(items, shape.sample_rows)
        want_logprobs = any(
            item.samples and item.seq.sampling_params is not None and item.seq.sampling_params.logprobs is not None
            for item in items
        )
        attention = PagedBatch(slot_mapping, block_tables, kv_lens, cu_q_lens, np.int32(len(items)))
        step = StepInput(token_ids, positions, attention, logits_indices.reshape(-1))
        return step, SampleInput(sampling, np.bool_(want_logprobs), draft_tokens, num_drafts)

    def _padding_input(self, shape: StepShape) -> tuple[StepInput, SampleInput]:
        """A step of `shape` with no sequence in it (for every replica, stacked, on several devices), with a draft
        model's distributions (zeros) where its verify steps take them."""
        step, inputs = self._step_template(shape)
        k = shape.num_draft_positions
        if self.draft_probs and k:
            probs = np.zeros((shape.sample_rows, k, self.config.vocab_size), np.float32)
            inputs = dataclasses.replace(inputs, draft_probs=self._stacked([probs] * self.data_parallel_size))
        return step, inputs

    def _step_template(self, shape: StepShape) -> tuple[StepInput, SampleInput]:
        """The arrays of a step of `shape` with no sequence in it, for every replica (stacked, on several devices),
        without a draft model's distributions."""
        empty = self.prepare(SchedulerOutput(scheduled=[], page_copies=[]), shape)
        return self._stacked([empty] * self.data_parallel_size)

    def _stacked(self, per_replica: list):
        """On several devices: the replicas' step arrays stacked on a leading axis (spec REPLICAS); on one, the one
        replica's as they are."""
        if self.mesh is None:
            return per_replica[0]
        assert len(per_replica) == self.data_parallel_size, (len(per_replica), self.data_parallel_size)
        return jax.tree.map(lambda *xs: np.stack(xs), *per_replica)

    def execute_replicas(
        self, outputs: list[SchedulerOutput], draft_probs: jax.Array | None = None
    ) -> list[StepOutput]:
        """Runs one step of every data-parallel replica (an output each, in order; empty ones are padding), as one
        program over the devices: their results, in order. draft_probs: from `propose` of the draft model, for its
        verify step (one replica)."""
        copies = [
            (src + r * self.pages_per_replica, dst + r * self.pages_per_replica)
            for r, output in enumerate(outputs)
            for src, dst in output.page_copies
        ]
        if copies:  # in the whole pool, whose pages each replica has a range of
            self.copy_pages(copies)
        start = time.perf_counter()
        shape = self.shape_for(*outputs)
        prepared = [self.prepare(output, shape) for output in outputs]
        step, sample_input = self._stacked(prepared)
        dispatched = time.perf_counter()
        self._send(Message.STEP, shape, (step, sample_input), flag=draft_probs is not None)
        if draft_probs is not None:  # from propose, on the device (stacked on several devices, as propose runs)
            sample_input = dataclasses.replace(sample_input, draft_probs=draft_probs)
        token_ids, num_accepted, logprobs = self._run_step(shape, step, sample_input)
        want_logprobs = any(bool(s.want_logprobs) for _, s in prepared)
        token_ids, num_accepted = fetch(token_ids), fetch(num_accepted)
        logprobs = tuple(fetch(x) for x in logprobs) if want_logprobs else (None, None, None)
        if self.mesh is None:  # one replica: give its results the replica axis they have on several devices
            token_ids, num_accepted = token_ids[None], num_accepted[None]
            logprobs = tuple(x if x is None else x[None] for x in logprobs)
        device_s = time.perf_counter() - dispatched
        results = []
        for r, output in enumerate(outputs):
            count = len(output.scheduled)
            mine = tuple(x if x is None else x[r, :count] for x in logprobs)
            results.append(
                StepOutput(token_ids[r, :count], num_accepted[r, :count], *mine, shape, dispatched - start, device_s)
            )
        return results

    def _run_step(self, shape: StepShape, step: StepInput, sample_input: SampleInput) -> tuple:
        """The step's forward pass and sampler, launched (see _sample_on_shard for what they return)."""
        forward, sampler = self._forward_program(shape), self._sampler_program(shape)
        hidden, self.kv_cache = forward(self.params, self.kv_cache, step)
        return sampler(self.params, hidden, sample_input)

    def reset_kv_cache(self) -> None:
        """A fresh, zeroed pool of the same shape (after a failed step, whose donated pool may be gone)."""
        self._send(Message.RESET)
        self.kv_cache = self._allocate_pool()

    # ----- several hosts (jaxpage.step_broadcast) -----

    def _send(self, kind: Message, key: StepShape | int = 0, payload=None, flag: int = 0) -> None:
        """On process 0 of several: tells the others the program launched next (key: its step shape, or a count)
        and its host-made arrays."""
        if self.channel is not None:
            key = self.shapes.index(key) if isinstance(key, StepShape) else key
            self.channel.send(kind, self.channel_runner, key, flag, payload)

    def replay(self, header: Header, data: bytes, draft_probs: jax.Array | None = None) -> jax.Array | None:
        """On a follower: launches the program process 0 launched (its message: header and data) on this process's
        devices, with the arrays it made. Returns a proposal's distributions (for the verify step that follows, as
        draft_probs), else None."""
        kind = header.kind
        if kind is Message.RESET:
            self.reset_kv_cache()
        elif kind is Message.COPY:
            self._copy(*unpack(data, (np.zeros(header.key, np.int32),) * 2))
        elif kind is Message.FORWARD:
            shape = self.shapes[header.key]
            self._run_forward(shape, unpack(data, self._step_template(shape)[0]))
        elif kind is Message.STEP:
            shape = self.shapes[header.key]
            step, sample_input = unpack(data, self._step_template(shape))
            if header.flag:
                sample_input = dataclasses.replace(sample_input, draft_probs=draft_probs)
            self._run_step(shape, step, sample_input)
        else:
            raise ValueError(f"a model runner cannot replay message {kind.name}")
        return None

    def payload_sizes(self) -> set[int]:
        """The bytes of every message's arrays this runner can send (for StepBroadcast.warmup)."""

        def size(tree) -> int:
            return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))

        sizes = {2 * COPY_CHUNK * np.dtype(np.int32).itemsize}
        for shape in self.shapes:
            step, sample_input = self._step_template(shape)
            sizes |= {size(step), size((step, sample_input))}
        return sizes

    def _allocate_pool(self) -> KVCache:
        """A zeroed pool, made on the device by a program that the compilation cache keeps like the step's (got
        once: a reset after a failed step reuses it)."""
        return self._pool_program()()

    def _pool_shardings(self) -> KVCache | None:
        """Where the pool's arrays live: sharded over the mesh, on the parameters' device when compiling only for
        one, else None (jax's default device)."""
        if self.mesh is not None:
            specs = dataclasses.astuple(self._pool_specs)
            return KVCache(*(None if spec is None else NamedSharding(self.mesh, spec) for spec in specs))
        if self.compile_only:
            return jax.tree.map(lambda _: self._replicated, self._pool_layout)
        return None

    def _pool_shapes(self) -> KVCache:
        """The pool as ShapeDtypeStructs placed where it would live (compile_only: the pool no program fills)."""
        where = self._pool_shardings()
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self._pool_layout, where)

    def _pool_program(self) -> jax.stages.Compiled:
        """The program that makes a zeroed pool (its output bytes: the pool's as the chip lays it out)."""
        if self._fill_pool is None:
            layout = self._pool_layout
            zeros = jax.jit(
                lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), layout),
                out_shardings=self._pool_shardings(),
            )
            arrays = tuple((x.shape, x.dtype.name) for x in jax.tree.leaves(layout))
            self._fill_pool = self._load_or_compile(
                CompiledShape("pool", layout.k.shape), (), lambda: zeros.lower().compile(), static=arrays
            )
            self._check_pool_bytes(self._fill_pool)
        return self._fill_pool

    def _check_pool_bytes(self, fill_pool: jax.stages.Compiled) -> None:
        if (undercount := self.pool_bytes_undercount(fill_pool)) is not None:
            logger.warning("%s", undercount)

    def pool_bytes_undercount(self, fill_pool: jax.stages.Compiled) -> str | None:
        """What is wrong when the chip lays the pool out >2% larger than its shape says (tiles that pad it): the
        budget arithmetic the engine sized the pool with then undercounts it. None otherwise (measured equal on TPU
        v5e/v6e/v5p and H100 for every KV format at page sizes 8, 16, 32; scripts/compile_for.py checks the same
        per target), or when the executable cannot describe itself."""
        try:
            compiled = fill_pool.memory_analysis().output_size_in_bytes
        except Exception:  # nothing to compare
            return None
        devices = 1 if self.mesh is None else self.mesh.size  # every pool array is split over every device
        shaped = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self._pool_layout)) // devices
        if compiled <= (1 + POOL_BYTES_TOLERANCE) * shaped:
            return None
        return (
            f"the KV pool takes {compiled} bytes per device as compiled, {100 * (compiled / shaped - 1):.1f}% more "
            f"than the {shaped} its shape and the budget arithmetic say: the memory budget undercounts it; lower "
            "gpu_memory_utilization or num_pages"
        )

    @property
    def _replicated(self):
        """The sharding of an argument every device holds whole: the mesh's, or the (compile-only) parameters'
        device."""
        if self.mesh is not None:
            return NamedSharding(self.mesh, P())
        return jax.tree.leaves(self.params)[0].sharding

    def _abstract(self, tree):
        """Host-made step arrays as compile_only lowers them: ShapeDtypeStructs every device holds whole (jit would
        otherwise place numpy arguments on this host's default device); unchanged otherwise."""
        if not self.compile_only:
            return tree
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=self._replicated), tree
        )

    def _copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        self._send(Message.COPY, len(src), (src, dst))
        if len(src) != COPY_CHUNK:  # the rare copy that must run in one call: compiled for its size here
            self.kv_cache = self._copy_pages_jit(self.kv_cache, src, dst)
            return
        self.kv_cache = self._copy_program()(self.kv_cache, src, dst)

    def _copy_program(self) -> jax.stages.Compiled:
        """The copy of COPY_CHUNK pages (compiled at its first use or at warm-up)."""
        if self._copy_chunk is None:
            ids = np.zeros(COPY_CHUNK, np.int32)
            args = (self.kv_cache, *self._abstract((ids, ids)))
            self._copy_chunk = self._load_or_compile(
                CompiledShape("copy", COPY_CHUNK), args, lambda: self._copy_pages_jit.lower(*args).compile()
            )
        return self._copy_chunk

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """The copy-on-write copies (src, dst) of a step, applied as if all at once (every source read before any
        destination is written). COPY_CHUNK at a time, so that one compiled program serves any number, unless a
        destination is also a source (a page freed and reused within the step): then in one call, whose size
        may compile anew (rare)."""
        sources = {src for src, _ in copies}
        chunk = COPY_CHUNK if not any(dst in sources for _, dst in copies) else max(COPY_CHUNK, len(copies))
        for start in range(0, len(copies), chunk):
            part = copies[start : start + chunk]
            size = COPY_CHUNK if chunk == COPY_CHUNK else 1 << (len(part) - 1).bit_length()
            src = np.zeros(size, np.int32)  # padded with (0, 0): copies of the null page onto itself
            dst = np.zeros(size, np.int32)
            src[: len(part)], dst[: len(part)] = zip(*part, strict=True)
            self._copy(src, dst)
