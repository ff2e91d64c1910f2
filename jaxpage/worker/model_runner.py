"""Turns a scheduled step into arrays, runs its two compiled programs on the device, returns sampled tokens.

A step is two programs, dispatched back to back: the forward pass (the model over the step's tokens, writing
their K/V into the pool) and the sampler (the LM head over the rows that sample, sampling, log-probs). The full
logits never leave the sampler; only token ids (and log-probs when asked) come back to the host.

Every step is padded to one of a few shapes (jaxpage.worker.step_shapes), each compiled once. Block tables have one
width, ceil(max_model_len / page_size) pages: attention reads each table only up to its sequence's kv length, so a wider
table costs a few bytes, not time.
`warmup()` compiles every shape; after it, no workload compiles anything new. With the persistent compilation
cache (on by default, see jaxpage.worker.compilation_cache) a later process loads them instead: no tracing, no
compiling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpage.attention import AttentionBackend, PagedAttention
from jaxpage.config import ModelConfig
from jaxpage.kv_cache import KVCache
from jaxpage.models.batch_invariant import in_row_tiles
from jaxpage.models.llama import Llama, build, params_dtype
from jaxpage.models.lora import split_lora
from jaxpage.sample.logits_processors import apply_logits_processors
from jaxpage.sample.rejection_sampler import verify_drafts
from jaxpage.sample.sampler import sample, sampled_logprobs, target_logprobs
from jaxpage.sampling_params import SamplingParams
from jaxpage.sequence import PROMPT_LOGPROB_TOKENS
from jaxpage.worker.compilation_cache import CompilationCache, CompiledShape, load_or_compile
from jaxpage.worker.kv_pool import COPY_CHUNK, KVPool, pool_arrays, pool_shape
from jaxpage.worker.lora_weights import LoRAWeights
from jaxpage.worker.parallel import DATA_AXIS, REPLICAS, TP_AXIS, on_shards, param_specs, shard_config
from jaxpage.worker.step_broadcast import Header, Message
from jaxpage.worker.step_inputs import (
    NO_PROCESSORS,
    PROCESSOR_LEVELS,
    SampleInput,
    StepInput,
    StepInputs,
    split_step_flag,
)
from jaxpage.worker.step_shapes import StepShape, step_shapes

logger = logging.getLogger("jaxpage")

MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS  # top logprobs a step returns when some row asks for logprobs


def fetch(x: jax.Array) -> np.ndarray:
    """A result on the host. One that spans the devices of several processes is whole on each device (gathered or
    replicated): this process reads its own copy."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


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
    # Prompt log-probs, a row each of jaxpage.sequence.prompt_logprob_rows(the step's items): the prompt token's
    # log-prob [rows], its rank [rows], the top MAX_LOGPROBS ids [rows, top] and their log-probs; None: none asked.
    prompt_logprobs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None


def sample_rows(logits: jax.Array, inputs: SampleInput, batch_invariant: bool = False) -> tuple:
    """The sampler's work on the LM head's logits [R * (k + 1), V] float32: logits processors, then sampling (k = 0)
    or the verification of each row's k drafts, then the log-probs when some row asks (see
    ModelRunner._sample_on_shard for what it returns). batch_invariant: every row in one shape, a tile of rows at a
    time (jaxpage.models.batch_invariant.in_row_tiles)."""
    rows, k = inputs.draft_tokens.shape
    if batch_invariant:
        return in_row_tiles(sample_rows, rows, logits, inputs)
    # Grammar masks, biases and penalties change what is sampled; log-probs stay the model's (vLLM's default).
    processed = logits if inputs.logits is None else apply_logits_processors(logits, inputs.logits)
    if k == 0:
        token_ids = sample(processed, inputs.sampling).token_ids[:, None]
        num_accepted = jnp.zeros(rows, jnp.int32)
    else:
        verified = verify_drafts(
            processed.reshape(rows, k + 1, -1),
            inputs.sampling,
            inputs.draft_tokens,
            inputs.num_drafts,
            inputs.draft_probs,
        )
        token_ids, num_accepted = verified.token_ids, verified.num_accepted
    flat_logits, flat_ids = logits, jnp.maximum(token_ids, 0).reshape(-1)
    top = min(MAX_LOGPROBS, flat_logits.shape[-1])  # a vocabulary can be smaller than MAX_LOGPROBS
    no_logprobs = (
        jnp.zeros(rows * (k + 1), jnp.float32),
        jnp.zeros((rows * (k + 1), top), jnp.int32),
        jnp.zeros((rows * (k + 1), top), jnp.float32),
    )
    logprobs = lax.cond(inputs.want_logprobs, lambda: sampled_logprobs(flat_logits, flat_ids, top), lambda: no_logprobs)
    logprobs = tuple(x.reshape(rows, k + 1, *x.shape[1:]) for x in logprobs)
    return token_ids, num_accepted, logprobs


def last_tokens(token_ids: jax.Array, num_accepted: jax.Array, rows: int) -> jax.Array:
    """[rows] int32: each sampler row's last token (after its accepted drafts), zeros past them: what the next step
    reads of them on the device (StepInput.fed_tokens, asynchronous scheduling)."""
    last = jnp.take_along_axis(token_ids, num_accepted[:, None], axis=1)[:, 0]
    return jnp.zeros(rows, jnp.int32).at[: last.shape[0]].set(last)


def abstract(tree, sharding):
    """Host-made step arrays as a compile-only program lowers them: ShapeDtypeStructs placed as `sharding` says
    (every device holding them whole; jit would otherwise place numpy arguments on this host's default device)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding), tree)


def sampler_name(rows: int, k: int, level: int) -> CompiledShape:
    """How the compile log names a sampler program: ("sample", rows) or ("verify", (rows, k)), with the level of
    logits processors after a "+" ("sample+masks", "verify+penalties")."""
    suffix = ("", "+masks", "+penalties")[level]
    return CompiledShape(f"verify{suffix}", (rows, k)) if k else CompiledShape(f"sample{suffix}", rows)


def matmul_precision(dtype):
    """The context a model of `dtype` compiles in: a float32 model's matrix products in float32 ("highest"), where
    jax's default precision would make them TF32 on a GPU and one bfloat16 pass on a TPU (vLLM's float32 gets float32
    products too: torch keeps TF32 off for them); other dtypes keep the caller's setting."""
    return jax.default_matmul_precision("highest") if dtype == jnp.float32 else contextlib.nullcontext()


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
        window_pages: int | None = None,
        max_num_batched_tokens: int,
        max_model_len: int,
        compilation_cache: CompilationCache | None = None,
        num_speculative_tokens: int = 0,
        max_verify_rows: int = 0,
        draft_probs: bool = False,
        mesh: jax.sharding.Mesh | None = None,
        compile_only: bool = False,
        lora: tuple[int, int] | None = None,  # (max_loras, max_lora_rank): LoRA adapters' slots, params["lora"]
    ):
        self.config = config  # the whole model's (with_replicated_kv_heads under tensor parallelism)
        # Programs built for chips this host lacks (jaxpage.aot): params are ShapeDtypeStructs placed on compile-only
        # devices, the pool is one too, and nothing runs.
        self.compile_only = compile_only
        self.compilation_cache = compilation_cache
        self.compiler_options: dict | None = None  # XLA's, for forward passes and proposals (aot: a dump dir)
        self.params = params
        self.backend = backend
        self.dtype = dtype = params_dtype(params)  # the compute dtype
        # Several devices (jaxpage.worker.parallel): every program runs one shard's model per device under shard_map,
        # each data-parallel replica on its own step (the step's arrays stacked over the replicas) and its own pages.
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        self.tensor_parallel_size = 1 if self.mesh is None else self.mesh.shape[TP_AXIS]
        self.data_parallel_size = 1 if self.mesh is None else self.mesh.shape[DATA_AXIS]
        self.pages_per_replica = num_pages
        # Every program this runner launches goes through `door` (kind, key, payload, flag, draft_probs), which calls
        # `run`; jaxpage.worker.executor.Executor makes it the one door to the device (several hosts hear of each).
        self.door = self.run
        self._gather_replicas = self.mesh is not None and self.mesh.is_multi_process
        self.lora = lora and LoRAWeights(
            config, *lora, dtype, self.mesh, self._replicated, compile_only, self._load_or_compile
        )
        self.params = params = params if self.lora is None else {**params, "lora": self.lora.arrays}
        self._param_specs = param_specs(params, config.expert_parallel_size > 1)
        tp_axis = TP_AXIS if self.tensor_parallel_size > 1 else None  # data parallelism alone: the whole model each
        shard = shard_config(config, self.tensor_parallel_size) if tp_axis else config
        self.compile_log: list[CompiledShape] = []  # every program compiled or loaded, in order
        self.window_pages_per_replica = window_pages  # a hybrid's grouped pool: its window group's pages
        grouped = window_pages is not None
        pages = (num_pages, window_pages, self.data_parallel_size, page_size)
        pool = pool_arrays(backend, config, *pages, dtype, self.tensor_parallel_size)
        replicated = self._replicated if compile_only else None
        self.pool = KVPool(*pool, self.mesh, replicated, self._abstract, self._load_or_compile)
        # Compile-only: the pool as ShapeDtypeStructs where it would live, which no program fills.
        self.pool.cache = self.pool.shapes() if compile_only else self.pool.allocate()
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.shapes = step_shapes(max_num_seqs, max_num_batched_tokens, num_speculative_tokens, max_verify_rows)
        # Verify steps take the draft model's distributions where draft_probs (else point masses).
        draft_vocab = config.vocab_size if draft_probs else 0
        stack = self.mesh is not None
        self.inputs = StepInputs(
            *(self.shapes, page_size, max_model_len, self.data_parallel_size, stack, draft_vocab, config.vocab_size),
            window_group=grouped,
            lora_slot=self.lora and self.lora.template(),
        )
        attention = functools.partial(PagedAttention, backend, config.attention_scale, config.sliding_window)
        sliding = config.sliding_layers if grouped else ()  # a grouped pool's layers write and read their group's
        self.models = {  # by the shapes' max_q_len
            q: build(shard, attention(q or None, sliding_layers=sliding), dtype, tp_axis, backend.platform)
            for q in {0, 1} | {s.max_q_len for s in self.shapes}
        }
        self.executables: dict[StepShape, jax.stages.Compiled] = {}  # the forward pass of each step shape
        # LM head and sampler, by (rows, k, logits processors' level: jaxpage.worker.step_inputs.PROCESSOR_LEVELS)
        self.samplers: dict[tuple[int, int, int], jax.stages.Compiled] = {}
        self._forward = jax.jit(self._forward_fn, donate_argnums=(1,), static_argnums=(3,))
        self._sample = jax.jit(self._sample_fn)
        self.prompt_logprobs_program: jax.stages.Compiled | None = None
        self.prompt_hidden: jax.Array | None = None  # the latest step's hidden rows for prompt log-probs
        self.last_tokens: jax.Array | None = None  # the latest step's last token of each sampler row (fed_tokens)

    @property
    def kv_cache(self) -> KVCache:
        """The pool's arrays (jaxpage.worker.kv_pool): every program that writes K/V takes them and gives them back."""
        return self.pool.cache

    @kv_cache.setter
    def kv_cache(self, cache: KVCache) -> None:
        self.pool.cache = cache

    @property
    def num_compilations(self) -> int:
        """Programs compiled (or loaded from the persistent cache) so far: forward shapes and sampler shapes."""
        return len(self.executables) + len(self.samplers) + (self.prompt_logprobs_program is not None)

    # ----- device side -----

    def _on_shards(self, fn, in_specs: tuple, out_specs, gather: bool = False):
        """fn (whose first argument is the parameters) as each device runs it (jaxpage.worker.parallel.on_shards)."""
        if self.mesh is None:
            return fn
        return on_shards(fn, self.mesh, self._param_specs, in_specs, out_specs, gather)

    def _forward_fn(self, params, kv_cache: KVCache, step: StepInput, max_q_len: int):
        """(hidden states [R * (k + 1), hidden] of the tokens the sampler's rows use, those [PROMPT_LOGPROB_TOKENS,
        hidden] of the tokens that give prompt log-probs, kv_cache with the step's K/V)."""

        def forward(params, kv_cache, step):
            params, lora = split_lora(params, step.lora_slots)
            hidden, kv_cache = self.models[max_q_len].apply(
                {"params": params}, step.with_fed_tokens(), step.positions, step.attention, kv_cache, lora
            )
            return hidden[step.logits_indices], hidden[step.prompt_indices], kv_cache

        pool = self.pool.specs
        return self._on_shards(forward, (pool, REPLICAS), (REPLICAS, REPLICAS, pool))(params, kv_cache, step)

    def _sample_fn(self, params, hidden: jax.Array, inputs: SampleInput):
        sample = self._on_shards(self._sample_on_shard, (REPLICAS, REPLICAS), REPLICAS, gather=self._gather_replicas)
        return sample(params, hidden, inputs)

    def _prompt_logprobs_fn(self, params, hidden: jax.Array, targets: jax.Array):
        """jaxpage.sample.sampler.target_logprobs of the LM head's logits [P, V] over the hidden rows [P, hidden]."""

        def on_shard(params, hidden, targets):
            logits = self.models[0].apply({"params": params}, hidden, method=Llama.logits)
            return target_logprobs(logits, targets, min(MAX_LOGPROBS, logits.shape[-1]))

        return self._on_shards(on_shard, (REPLICAS, REPLICAS), REPLICAS, self._gather_replicas)(params, hidden, targets)

    def _sample_on_shard(self, params, hidden: jax.Array, inputs: SampleInput):
        """(token ids [R, k + 1], accepted draft tokens [R], (log-probs of the tokens [R, k + 1], top ids
        [R, k + 1, MAX_LOGPROBS], top log-probs)). With k = 0 each row samples one token; with k > 0 each row's
        drafts are verified (jaxpage.sample.rejection_sampler). The full logits never leave this function; the log-probs
        are computed only when some row asks for them."""
        logits = self.models[0].apply({"params": params}, hidden, method=Llama.logits)  # [R * (k + 1), V] float32
        token_ids, num_accepted, logprobs = sample_rows(logits, inputs, self.config.batch_invariant)
        return token_ids, num_accepted, logprobs, last_tokens(token_ids, num_accepted, self.inputs.max_sample_rows)

    def compile(self, shape: StepShape) -> jax.stages.Compiled:
        """The forward pass of `shape`: from the compilation cache, else lowered and compiled (and kept there)."""
        args = (self.params, self.kv_cache, self._abstract(self.inputs.padding(shape)[0]))
        lower, what = functools.partial(self._forward.lower, *args, shape.max_q_len), CompiledShape("forward", shape)
        self.executables[shape] = self._load_or_compile(what, args, lambda: lower().compile(self.compiler_options))
        return self.executables[shape]

    def compile_sampler(self, shape: StepShape, level: int = NO_PROCESSORS) -> jax.stages.Compiled:
        """The LM head and sampler (or verification) of `shape`'s sample rows and k, with logits processors as
        `level` says, as `compile` gets the forward pass; keyed by the rows its last tokens are padded to too."""
        rows, k = shape.sample_rows, shape.num_draft_positions
        _, inputs = self.inputs.padding(shape, level)
        args = (self.params, self._hidden_rows(rows * (k + 1)), self._abstract(inputs))
        what, static = sampler_name(rows, k, level), (self.config, self.backend, rows, k, self.inputs.max_sample_rows)
        executable = self._load_or_compile(what, args, lambda: self._sample.lower(*args).compile(), static)
        self.samplers[rows, k, level] = executable
        return executable

    def compile_prompt_logprobs(self) -> jax.stages.Compiled:
        """The prompt log-probs program (LM head over PROMPT_LOGPROB_TOKENS hidden rows), got as `compile` does."""
        if self.prompt_logprobs_program is None:
            hidden, targets = self._hidden_rows(PROMPT_LOGPROB_TOKENS), self.inputs.prompt_targets_template()
            args, program = (self.params, hidden, self._abstract(targets)), jax.jit(self._prompt_logprobs_fn)
            what = CompiledShape("prompt_logprobs", PROMPT_LOGPROB_TOKENS)
            self.prompt_logprobs_program = self._load_or_compile(what, args, lambda: program.lower(*args).compile())
        return self.prompt_logprobs_program

    def _hidden_rows(self, rows: int) -> jax.ShapeDtypeStruct:
        """What the forward pass hands a program that takes `rows` of its hidden states (stacked over the replicas
        on several devices), and where it leaves them."""
        stacked = () if self.mesh is None else (self.data_parallel_size,)
        placed = self._replicated if self.mesh is None else NamedSharding(self.mesh, REPLICAS)
        return jax.ShapeDtypeStruct(
            (*stacked, rows, self.config.hidden_size), self.dtype, sharding=placed if self.compile_only else None
        )

    def _load_or_compile(self, what: CompiledShape, args: tuple, compile_it, static=None) -> jax.stages.Compiled:
        """The program `what` (jaxpage.worker.compilation_cache.load_or_compile), keyed by `static` (default: the model
        config, the attention backend and what.shape) and the arguments' shapes and dtypes; logged."""
        static = (*((self.config, self.backend, what.shape) if static is None else static), self.tensor_parallel_size)
        devices = [jax.devices()[0]] if self.mesh is None else list(self.mesh.devices.flat)
        with matmul_precision(self.dtype):
            cache = None if self.compiler_options else self.compilation_cache  # an option may change the program
            executable, done = load_or_compile(cache, what, static, args, devices, compile_it)
        self.compile_log.append(done)
        logger.info("%s", done)
        return executable

    def warmup(self) -> list[CompiledShape]:
        """Compiles every step shape and sampler shape not compiled yet (and the page copy); returns what it
        compiled."""
        start = len(self.compile_log)
        for _, get in self.warmup_programs():
            get()
        return self.compile_log[start:]

    def warmup_programs(self) -> list[tuple[CompiledShape, Callable[[], jax.stages.Compiled]]]:
        """Every program warm-up compiles, as (what it is, a function that returns it compiled: at its first call
        compiled or loaded, later the same program), in warm-up's order: the pool's fill (compiled when the runner
        is built, unless compile_only), the forward pass of each step shape with its samplers (each sampler shape
        once, in each variant of logits processors), the page copy, the host tier's copies."""
        programs = [self._pool_warmup()]
        samplers = set()
        for shape in self.shapes:
            programs.append((CompiledShape("forward", shape), functools.partial(self._forward_program, shape)))
            rows, k = shape.sample_rows, shape.num_draft_positions
            for level in PROCESSOR_LEVELS:
                if (rows, k, level) not in samplers:
                    samplers.add((rows, k, level))
                    program = functools.partial(self._sampler_program, shape, level)
                    programs.append((sampler_name(rows, k, level), program))
        programs.append((CompiledShape("prompt_logprobs", PROMPT_LOGPROB_TOKENS), self.compile_prompt_logprobs))
        programs.append((CompiledShape("copy", COPY_CHUNK), self.pool.copy_program))
        programs += self.pool.host_programs()
        programs += [(CompiledShape("lora", self.lora.shape), self.lora.fill_program)] if self.lora else []
        return programs

    def _pool_warmup(self) -> tuple[CompiledShape, Callable[[], jax.stages.Compiled]]:
        return CompiledShape("pool", pool_shape(self.pool.layout)), self.pool.fill_program

    def _forward_program(self, shape: StepShape) -> jax.stages.Compiled:
        return self.executables.get(shape) or self.compile(shape)

    def _sampler_program(self, shape: StepShape, level: int = NO_PROCESSORS) -> jax.stages.Compiled:
        key = (shape.sample_rows, shape.num_draft_positions, level)
        return self.samplers.get(key) or self.compile_sampler(shape, level)

    # ----- host side -----

    def _run_step(self, shape: StepShape, step: StepInput, sample_input: SampleInput, level: int) -> tuple:
        """The step's forward pass and sampler, launched (see _sample_on_shard); its rows' last tokens stay here."""
        forward, sampler = self._forward_program(shape), self._sampler_program(shape, level)
        hidden, self.prompt_hidden, self.kv_cache = forward(self.params, self.kv_cache, step)
        *results, self.last_tokens = sampler(self.params, hidden, sample_input)
        return tuple(results)

    def reset_kv_cache(self) -> None:
        """A fresh, zeroed pool of the same shape (after a failed step, whose donated pool may be gone)."""
        self._launch(Message.RESET)

    # ----- launching programs: one dispatch, on process 0 and on the processes that follow it -----

    def _launch(self, kind: Message, key: StepShape | int = 0, payload=None, flag: int = 0, draft_probs=None):
        """Launches a program through the door (key: its step shape, or a count): what `run` returns."""
        key = self.shapes.index(key) if isinstance(key, StepShape) else key
        return self.door(kind, key, payload, flag, draft_probs)

    def run(self, kind: Message, key: int, payload, flag: int = 0, draft_probs=None):
        """Launches the program of message `kind` (key: a step shape's index, or a count) with its host-made arrays
        `payload`: a STEP returns the sampler's device arrays (see _sample_on_shard); others return None. flag
        (STEP, see step_flag): the sampler's level of logits processors, and whether it takes `draft_probs`, a draft
        model's distributions, already on the device."""
        if kind in (Message.RESET, Message.COPY, Message.OFFLOAD, Message.LOAD):
            self.pool.run(kind, key, payload)
        elif kind is Message.FORWARD:
            _, _, self.kv_cache = self._forward_program(self.shapes[key])(self.params, self.kv_cache, payload)
        elif kind is Message.STEP:
            step, sample_input = payload
            level, feeds, with_draft_probs = split_step_flag(flag)
            if with_draft_probs:
                sample_input = dataclasses.replace(sample_input, draft_probs=draft_probs)
            if feeds:  # tokens of the step before, read on the device (StepInput.feed_index)
                step = dataclasses.replace(step, fed_tokens=self.last_tokens)
            return self._run_step(self.shapes[key], step, sample_input, level)
        elif kind is Message.LORA:
            self.params["lora"] = self.lora.fill(key, payload)
        elif kind is Message.PROMPT_LOGPROBS:
            return self.compile_prompt_logprobs()(self.params, self.prompt_hidden, payload)
        else:
            raise ValueError(f"a model runner cannot run message {kind.name}")
        return None

    def unpack(self, header: Header, data: bytes):
        """The payload of a message process 0 sent (jaxpage.worker.step_broadcast), as `run` takes it."""
        return self.inputs.unpack(header, data)

    def payload_sizes(self) -> set[int]:
        """The bytes of every message's arrays this runner can send (for StepBroadcast.warmup)."""
        return self.inputs.payload_sizes()

    @property
    def _replicated(self):
        """The sharding of an argument every device holds whole: the mesh's, or the (compile-only) parameters'
        device."""
        if self.mesh is not None:
            return NamedSharding(self.mesh, P())
        return jax.tree.leaves(self.params)[0].sharding

    def _abstract(self, tree):
        """Host-made step arrays as compile_only lowers them (see abstract); unchanged otherwise."""
        return abstract(tree, self._replicated) if self.compile_only else tree

    def copy_pages(self, copies: list[tuple[int, int]], window_copies: list[tuple[int, int]] = ()) -> None:
        """The copy-on-write copies (src, dst) of a step (and of a grouped pool's window group), as KVPool.chunks
        makes them, launched through the door."""
        for src, dst in self.pool.chunks(copies, window_copies):
            self._launch(Message.COPY, src.shape[-1], (src, dst))
