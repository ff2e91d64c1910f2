"""Turns a scheduled step into arrays, runs its two compiled programs on the device, returns sampled tokens.

A step is two programs, dispatched back to back: the forward pass (the model over the step's tokens, writing
their K/V into the pool) and the sampler (the LM head over the rows that sample, sampling, log-probs). The full
logits never leave the sampler; only token ids (and log-probs when asked) come back to the host.

Shapes. Every step is padded to one of a few shapes, and each is compiled once, ahead of its first use:
  decode-only steps (every sequence has one new token): T tokens = S rows, a power of two from 4, or 24 or 48, up
      to the most sequences a step can hold (min(max_num_seqs, max_num_batched_tokens), always the last);
  mixed steps (some sequence computes several tokens): T = 128, 512, 2048, ... up to max_num_batched_tokens (always
      the last), S = min(T, max_num_seqs).
The sampler takes R >= S rows, R = 8, 32, 128, ... up to the most sequences: it compiles once per R, shared by
decode and mixed steps. Whether a step is decode-only is known here, on the host: a decode-only step compiles only
the decode attention. Block tables have one width, ceil(max_model_len / page_size) pages: attention reads each
table only up to its sequence's kv length, so a wider table costs a few bytes, not time.
`warmup()` compiles every shape; after it, no workload compiles anything new. With the persistent compilation
cache (on by default, see jaxpage.compilation_cache) a later process loads them instead: no tracing, no compiling.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpage.attention_backend import AttentionBackend, PagedAttention, PagedBatch
from jaxpage.compilation_cache import CompilationCache, program_key
from jaxpage.config import ModelConfig
from jaxpage.kv_cache import KVCache, copy_pages
from jaxpage.models.llama import Llama, build
from jaxpage.sampler import SamplingMetadata, sample, sampled_logprobs, sampling_metadata_from_params
from jaxpage.sampling_params import SamplingParams
from jaxpage.scheduler import SchedulerOutput

logger = logging.getLogger("jaxpage")

# Bucket sizes, by measurement (scripts/bench_throughput.py, SmolLM2 float32 on 2 cores). A decode step computes
# every row of its bucket, about 2 ms of model FLOPs per padding row here: decode buckets are powers of two from 4
# with 24 and 48 between (a step of 25-48 sequences took 420 ms padded to 32/64, 270-350 ms at 24/48). Mixed steps
# are mostly full prefill chunks: buckets 128, 512, 2048, ... and the token budget. The sampler's rows (its LM head
# reads every row) go by powers of 4 from 8: it compiles once per row count, shared by decode and mixed steps.
MIN_DECODE_BUCKET = 4
DECODE_HALF_STEPS = (16, 32)  # decode buckets also at 1.5 x these: 24, 48
MIN_MIXED_BUCKET = 128
MIN_SAMPLE_ROWS = 8
COPY_CHUNK = 8  # copy-on-write page copies per call of the (one) compiled copy program
MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS  # top logprobs a step returns when some row asks for logprobs


def powers_of_two(lo: int, hi: int, factor: int = 2) -> list[int]:
    """lo, 2 lo, 4 lo, ... below hi, then hi itself (always the last; [hi] when hi <= lo). `factor` 4 gives lo,
    4 lo, 16 lo, ..."""
    buckets = []
    size = lo
    while size < hi:
        buckets.append(size)
        size *= factor
    return [*buckets, hi]


def bucket_for(n: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= n)


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    """The static shape of a step's forward pass."""

    num_tokens: int  # T
    num_rows: int  # S: sequence rows (block tables, kv lengths)
    sample_rows: int  # R >= S: rows of the sampler (its own, coarser buckets: it compiles once per R)
    decode_only: bool

    def __str__(self) -> str:
        kind = "decode" if self.decode_only else "mixed"
        return f"{kind}(T={self.num_tokens}, S={self.num_rows}, R={self.sample_rows})"


def step_shapes(max_num_seqs: int, max_num_batched_tokens: int) -> list[StepShape]:
    """Every shape a step can take, decode-only shapes first, small to large."""
    max_rows = min(max_num_seqs, max_num_batched_tokens)  # the most sequences a step can hold
    sample_rows = powers_of_two(MIN_SAMPLE_ROWS, max_rows, factor=4)
    decode_sizes = powers_of_two(MIN_DECODE_BUCKET, max_rows)
    decode_sizes = sorted(set(decode_sizes) | {t * 3 // 2 for t in DECODE_HALF_STEPS if t * 3 // 2 < max_rows})
    decode = [StepShape(t, t, bucket_for(t, sample_rows), True) for t in decode_sizes]
    mixed = [
        StepShape(t, min(t, max_num_seqs), bucket_for(min(t, max_num_seqs), sample_rows), False)
        for t in powers_of_two(MIN_MIXED_BUCKET, max_num_batched_tokens, factor=4)
    ]
    return decode + mixed


@dataclasses.dataclass(frozen=True)
class CompiledShape:
    program: str  # "forward" (the model, for a StepShape), "sample" (LM head and sampler, for R rows), "pool", "copy"
    shape: StepShape | int | tuple
    seconds: float = 0.0  # lowering and compiling (or loading from a cache)
    loaded: bool = False  # from the compilation cache: neither traced, lowered nor compiled

    def __str__(self) -> str:
        shape = f"rows={self.shape}" if self.program == "sample" else self.shape
        return f"{self.program} {shape}: {'loaded' if self.loaded else 'compiled'} in {self.seconds:.2f}s"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    token_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    attention: PagedBatch
    logits_indices: jax.Array  # [R] int32, the token whose logits each sampler row samples from


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleInput:
    sampling: SamplingMetadata  # [R] rows
    want_logprobs: jax.Array  # [] bool: some row asks for logprobs (else they are not computed)


@dataclasses.dataclass(frozen=True)
class StepOutput:
    token_ids: np.ndarray  # [num scheduled] int32; meaningful where the scheduled item samples
    logprobs: np.ndarray | None  # [num scheduled] float32, log-prob of the sampled token; None unless asked
    top_logprob_ids: np.ndarray | None  # [num scheduled, MAX_LOGPROBS] int32
    top_logprobs: np.ndarray | None  # [num scheduled, MAX_LOGPROBS] float32
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
    ):
        self.config = config
        self.compilation_cache = compilation_cache
        self.params = params
        self.backend = backend
        dtype = params["embed_tokens"]["embedding"].dtype
        self.compile_log: list[CompiledShape] = []  # every program compiled or loaded, in order
        self._pool_shape = backend.pool_shape(config, num_pages, page_size)
        self._fill_pool = None  # the program that makes a zeroed K or V pool
        self.kv_cache = self._allocate_pool(dtype)
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.shapes = step_shapes(max_num_seqs, max_num_batched_tokens)
        self.block_table_width = math.ceil(max_model_len / page_size)
        self.models = {
            decode_only: build(
                config, PagedAttention(backend, config.head_dim**-0.5, config.sliding_window, decode_only), dtype
            )
            for decode_only in (False, True)
        }
        self.executables: dict[StepShape, jax.stages.Compiled] = {}  # the forward pass of each step shape
        self.samplers: dict[int, jax.stages.Compiled] = {}  # LM head and sampler, by rows
        self._forward = jax.jit(self._forward_fn, donate_argnums=(1,), static_argnums=(3,))
        self._sample = jax.jit(self._sample_fn)
        self._copy_pages_jit = jax.jit(copy_pages, donate_argnums=(0,))
        self._copy_chunk = None  # the copy of COPY_CHUNK pages, compiled at its first use

    @property
    def num_compilations(self) -> int:
        """Programs compiled (or loaded from the persistent cache) so far: forward shapes and sampler shapes."""
        return len(self.executables) + len(self.samplers)

    # ----- device side -----

    def _forward_fn(self, params, kv_cache: KVCache, step: StepInput, decode_only: bool):
        """(hidden states [R, hidden] of the tokens the sampler's rows sample from, kv_cache with the step's K/V)."""
        hidden, kv_cache = self.models[decode_only].apply(
            {"params": params}, step.token_ids, step.positions, step.attention, kv_cache
        )
        return hidden[step.logits_indices], kv_cache

    def _sample_fn(self, params, hidden: jax.Array, inputs: SampleInput):
        """(token ids [R], (their log-probs [R], top ids [R, MAX_LOGPROBS], top log-probs)): the full logits
        never leave this function; the log-probs are computed only when some row asks for them."""
        logits = self.models[False].apply({"params": params}, hidden, method=Llama.logits)  # [R, V] float32
        token_ids = sample(logits, inputs.sampling).token_ids
        rows = logits.shape[0]
        no_logprobs = (
            jnp.zeros(rows, jnp.float32),
            jnp.zeros((rows, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((rows, MAX_LOGPROBS), jnp.float32),
        )
        logprobs = lax.cond(
            inputs.want_logprobs, lambda: sampled_logprobs(logits, token_ids, MAX_LOGPROBS), lambda: no_logprobs
        )
        return token_ids, logprobs

    def compile(self, shape: StepShape) -> jax.stages.Compiled:
        """The forward pass of `shape`: from the compilation cache, else lowered and compiled (and kept there)."""
        step, _ = self._padding_input(shape)
        args = (self.params, self.kv_cache, step)
        executable = self._load_or_compile(
            CompiledShape("forward", shape), args, lambda: self._forward.lower(*args, shape.decode_only).compile()
        )
        self.executables[shape] = executable
        return executable

    def compile_sampler(self, rows: int) -> jax.stages.Compiled:
        """The LM head and sampler for `rows` rows, as `compile` gets the forward pass."""
        shape = next(s for s in self.shapes if s.sample_rows == rows)
        _, inputs = self._padding_input(shape)
        hidden = jax.ShapeDtypeStruct((rows, self.config.hidden_size), self.kv_cache.k.dtype)
        args = (self.params, hidden, inputs)
        executable = self._load_or_compile(
            CompiledShape("sample", rows), args, lambda: self._sample.lower(*args).compile()
        )
        self.samplers[rows] = executable
        return executable

    def _load_or_compile(self, what: CompiledShape, args: tuple, compile_it, static=None) -> jax.stages.Compiled:
        """The program `what` from the compilation cache, else compile_it() (kept in the cache). Its key: `static`
        (default: the model config, the attention backend and what.shape) and the arguments' shapes and dtypes."""
        start = time.perf_counter()
        key = None
        if self.compilation_cache is not None:
            static = (self.config, self.backend, what.shape) if static is None else static
            key = program_key(what.program, static, args)
            executable = self.compilation_cache.load(key)
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
        start = len(self.compile_log)
        for shape in self.shapes:
            if shape not in self.executables:
                self.compile(shape)
            if shape.sample_rows not in self.samplers:
                self.compile_sampler(shape.sample_rows)
        self.copy_pages([(0, 0)])
        return self.compile_log[start:]

    # ----- host side -----

    def shape_for(self, output: SchedulerOutput) -> StepShape:
        decode_only = all(item.num_new_tokens == 1 for item in output.scheduled)
        size = len(output.scheduled) if decode_only else output.num_batched_tokens
        return next(s for s in self.shapes if s.decode_only == decode_only and s.num_tokens >= size)

    def prepare(self, output: SchedulerOutput, shape: StepShape) -> tuple[StepInput, SampleInput]:
        """The step's arrays (numpy), padded to `shape`: the forward pass's and the sampler's."""
        items = output.scheduled
        page_size = self.page_size
        assert len(items) <= shape.num_rows, (len(items), shape)
        token_ids = np.zeros(shape.num_tokens, np.int32)
        positions = np.zeros(shape.num_tokens, np.int32)
        slot_mapping = np.zeros(shape.num_tokens, np.int32)  # padding tokens write into the null page
        cu_q_lens = np.zeros(shape.num_rows + 1, np.int32)
        kv_lens = np.zeros(shape.num_rows, np.int32)
        block_tables = np.zeros((shape.num_rows, self.block_table_width), np.int32)
        logits_indices = np.zeros(shape.sample_rows, np.int32)
        start = 0
        for row, item in enumerate(items):
            seq, computed, n = item.seq, item.num_computed_tokens, item.num_new_tokens
            end = start + n
            token_ids[start:end] = seq.token_ids[computed : computed + n]
            pos = np.arange(computed, computed + n, dtype=np.int32)
            positions[start:end] = pos
            table = np.asarray(seq.block_table, np.int32)
            slot_mapping[start:end] = table[pos // page_size] * page_size + pos % page_size
            block_tables[row, : len(table)] = table
            kv_lens[row] = computed + n
            logits_indices[row] = end - 1
            cu_q_lens[row + 1] = end
            start = end
        cu_q_lens[len(items) + 1 :] = start
        sampling = sampling_metadata_from_params(
            [item.seq.sampling_params if item.samples else None for item in items],
            steps=[len(item.seq.output_token_ids) for item in items],
            seeds=[item.seq.seed for item in items],
            num_rows=shape.sample_rows,
        )
        want_logprobs = any(
            item.samples and item.seq.sampling_params is not None and item.seq.sampling_params.logprobs is not None
            for item in items
        )
        attention = PagedBatch(slot_mapping, block_tables, kv_lens, cu_q_lens, np.int32(len(items)))
        step = StepInput(token_ids, positions, attention, logits_indices)
        return step, SampleInput(sampling, np.bool_(want_logprobs))

    def _padding_input(self, shape: StepShape) -> tuple[StepInput, SampleInput]:
        """A step of `shape` with no sequence in it."""
        return self.prepare(SchedulerOutput(scheduled=[], page_copies=[]), shape)

    def execute(self, output: SchedulerOutput) -> StepOutput:
        if output.page_copies:
            self.copy_pages(output.page_copies)
        start = time.perf_counter()
        shape = self.shape_for(output)
        step, sample_input = self.prepare(output, shape)
        dispatched = time.perf_counter()
        forward = self.executables.get(shape) or self.compile(shape)
        sampler = self.samplers.get(shape.sample_rows) or self.compile_sampler(shape.sample_rows)
        hidden, self.kv_cache = forward(self.params, self.kv_cache, step)
        token_ids, logprobs = sampler(self.params, hidden, sample_input)
        count = len(output.scheduled)
        logprobs = tuple(np.asarray(x)[:count] for x in logprobs) if sample_input.want_logprobs else (None, None, None)
        token_ids = np.asarray(token_ids)[:count]
        return StepOutput(token_ids, *logprobs, shape, dispatched - start, time.perf_counter() - dispatched)

    def reset_kv_cache(self) -> None:
        """A fresh, zeroed pool of the same shape (after a failed step, whose donated pool may be gone)."""
        self.kv_cache = self._allocate_pool(self.kv_cache.k.dtype)

    def _allocate_pool(self, dtype) -> KVCache:
        """A zeroed pool, made on the device by a program that the compilation cache keeps like the step's (got
        once: a reset after a failed step reuses it)."""
        if self._fill_pool is None:
            shape = self._pool_shape
            zeros = jax.jit(lambda: jnp.zeros(shape, dtype))
            self._fill_pool = self._load_or_compile(
                CompiledShape("pool", shape), (), lambda: zeros.lower().compile(), static=(shape, jnp.dtype(dtype).name)
            )
        return KVCache(k=self._fill_pool(), v=self._fill_pool())

    def _copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        if len(src) != COPY_CHUNK:  # the rare copy that must run in one call: compiled for its size here
            self.kv_cache = self._copy_pages_jit(self.kv_cache, src, dst)
            return
        if self._copy_chunk is None:
            args = (self.kv_cache, src, dst)
            self._copy_chunk = self._load_or_compile(
                CompiledShape("copy", COPY_CHUNK), args, lambda: self._copy_pages_jit.lower(*args).compile()
            )
        self.kv_cache = self._copy_chunk(self.kv_cache, src, dst)

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
