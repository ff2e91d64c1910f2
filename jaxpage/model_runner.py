"""Turns a scheduled step into int32 arrays, runs the jitted step on the device, returns sampled tokens.

Buckets. Every step is padded to a shape from a small fixed set, so the step compiles once per shape:
  T  tokens: powers of two from 16 up to max_num_batched_tokens (which is always one of them);
  S  sequence rows: min(T, max_num_seqs) (a step never has more sequences than tokens);
  P  block-table width in pages: powers of two from 4 up to ceil(max_model_len / page_size).
`warmup()` compiles every (T, P) pair; after it, no workload compiles anything new.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.config import ModelConfig
from jaxpage.kv_cache import KVCache, PagedAttention, PagedBatch, copy_pages, pool_head_dim
from jaxpage.models.llama import Llama, build
from jaxpage.sampler import SamplingMetadata, sample, sampling_metadata_from_params
from jaxpage.scheduler import SchedulerOutput

MIN_TOKEN_BUCKET = 4
MIN_PAGE_BUCKET = 4
# Token buckets also at 1.5 x these powers of two: a decode step computes every row of its bucket, and while
# steps are small that is what they cost. Measured on CPU (SmolLM2, float32, 2 cores), median decode step:
# 8 sequences 143 ms in a 16-token bucket, 91 ms in an 8-token one; 24 sequences 217 ms (32) against 186 ms (24).
# Larger steps are near the matmul rate, where padding costs little: the 1.5 x buckets stop at 96.
HALF_STEP_BUCKETS = (16, 32, 64)


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """The step sizes a step's tokens are padded to: powers of two from MIN_TOKEN_BUCKET, 24, 48 and 96, and
    max_num_batched_tokens itself last."""
    top = max(max_num_batched_tokens, MIN_TOKEN_BUCKET)
    buckets = powers_of_two(MIN_TOKEN_BUCKET, top)
    return sorted(set(buckets) | {b * 3 // 2 for b in HALF_STEP_BUCKETS if b * 3 // 2 < top})


def powers_of_two(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, 4 lo, ... up to and including hi (hi itself is always the last)."""
    buckets = []
    size = lo
    while size < hi:
        buckets.append(size)
        size *= 2
    return [*buckets, hi]


def bucket_for(n: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= n)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    token_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    attention: PagedBatch
    logits_indices: jax.Array  # [S] int32, the token whose logits each row samples from
    sampling: SamplingMetadata  # [S] rows


@dataclasses.dataclass(frozen=True)
class StepOutput:
    token_ids: np.ndarray  # [num scheduled] int32; meaningful where the scheduled item samples
    logprobs: np.ndarray | None  # [num scheduled] float32, log-prob of the sampled token
    top_logprob_ids: np.ndarray | None  # [num scheduled, MAX_LOGPROBS]
    top_logprobs: np.ndarray | None
    prepare_s: float = 0.0  # host: building the step's arrays
    device_s: float = 0.0  # dispatch until the sampled tokens are back on the host


MAX_LOGPROBS = 20


@functools.partial(jax.jit, static_argnames=("num",))
def top_logprobs(logits: jax.Array, token_ids: jax.Array, num: int = MAX_LOGPROBS):
    """(log-prob of token_ids [S], top-`num` ids [S, num], their log-probs [S, num]) of logits [S, V]."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    sampled = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
    values, ids = jax.lax.top_k(logprobs, num)
    return sampled, ids, values


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        params: dict,
        *,
        num_pages: int,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        attention_impl: str = "auto",
    ):
        self.config = config
        self.params = params
        dtype = params["embed_tokens"]["embedding"].dtype
        head_dim = pool_head_dim(config.head_dim, attention_impl)
        self.kv_cache = KVCache.allocate(config, num_pages, page_size, dtype, head_dim)
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.token_buckets = token_buckets(max_num_batched_tokens)
        max_pages = math.ceil(max_model_len / page_size)
        self.page_buckets = powers_of_two(min(MIN_PAGE_BUCKET, max_pages), max_pages)
        attention = PagedAttention(config.head_dim**-0.5, config.sliding_window, attention_impl)
        self.model = build(config, attention, dtype)
        self.num_compilations = 0  # traces of the step function: one per bucket shape
        self._step = jax.jit(self._step_fn, donate_argnums=(1,))
        self._copy_pages = jax.jit(copy_pages, donate_argnums=(0,))

    # ----- device side -----

    def _step_fn(self, params, kv_cache: KVCache, step: StepInput):
        self.num_compilations += 1  # runs only while tracing
        variables = {"params": params}
        hidden, kv_cache = self.model.apply(variables, step.token_ids, step.positions, step.attention, kv_cache)
        logits = self.model.apply(variables, hidden[step.logits_indices], method=Llama.logits)  # [S, V] float32
        sampled = sample(logits, step.sampling)
        return sampled.token_ids, logits, kv_cache

    # ----- host side -----

    def bucket_shape(self, num_tokens: int, max_pages: int) -> tuple[int, int, int]:
        tokens = bucket_for(num_tokens, self.token_buckets)
        return tokens, min(tokens, self.max_num_seqs), bucket_for(max(max_pages, 1), self.page_buckets)

    def prepare(self, output: SchedulerOutput) -> StepInput:
        """The step's int32 arrays (numpy), padded to its bucket."""
        items = output.scheduled
        page_size = self.page_size
        max_pages = max(len(item.seq.block_table) for item in items)
        num_tokens_bucket, num_rows, num_pages_bucket = self.bucket_shape(output.num_batched_tokens, max_pages)
        assert len(items) <= num_rows, (len(items), num_rows)
        token_ids = np.zeros(num_tokens_bucket, np.int32)
        positions = np.zeros(num_tokens_bucket, np.int32)
        slot_mapping = np.zeros(num_tokens_bucket, np.int32)  # padding tokens write into the null page
        cu_q_lens = np.zeros(num_rows + 1, np.int32)
        kv_lens = np.zeros(num_rows, np.int32)
        block_tables = np.zeros((num_rows, num_pages_bucket), np.int32)
        logits_indices = np.zeros(num_rows, np.int32)
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
            num_rows=num_rows,
        )
        attention = PagedBatch(slot_mapping, block_tables, kv_lens, cu_q_lens, np.int32(len(items)))
        return StepInput(token_ids, positions, attention, logits_indices, sampling)

    def execute(self, output: SchedulerOutput) -> StepOutput:
        if output.page_copies:
            self.copy_pages(output.page_copies)
        start = time.perf_counter()
        step = self.prepare(output)
        dispatched = time.perf_counter()
        token_ids, logits, self.kv_cache = self._step(self.params, self.kv_cache, step)
        count = len(output.scheduled)
        want_logprobs = any(
            item.samples and item.seq.sampling_params is not None and item.seq.sampling_params.logprobs is not None
            for item in output.scheduled
        )
        logprobs = (None, None, None)
        if want_logprobs:
            logprobs = tuple(np.asarray(x)[:count] for x in top_logprobs(logits, token_ids))
        token_ids = np.asarray(token_ids)[:count]
        return StepOutput(token_ids, *logprobs, dispatched - start, time.perf_counter() - dispatched)

    def reset_kv_cache(self) -> None:
        """A fresh, zeroed pool of the same shape (after a failed step, whose donated pool may be gone)."""
        k = self.kv_cache.k
        self.kv_cache = KVCache.allocate(self.config, k.shape[1], k.shape[2], k.dtype, k.shape[4])

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        size = max(8, 1 << (len(copies) - 1).bit_length())  # padded with (0, 0): copies of the null page
        src = np.zeros(size, np.int32)
        dst = np.zeros(size, np.int32)
        src[: len(copies)], dst[: len(copies)] = zip(*copies, strict=True)
        self.kv_cache = self._copy_pages(self.kv_cache, src, dst)

    def warmup(self) -> None:
        """Compiles the step for every bucket (and the logprobs and page-copy functions), running on padding only."""
        for num_tokens in self.token_buckets:
            for num_pages in self.page_buckets:
                num_rows = min(num_tokens, self.max_num_seqs)
                step = StepInput(
                    token_ids=np.zeros(num_tokens, np.int32),
                    positions=np.zeros(num_tokens, np.int32),
                    attention=PagedBatch(
                        slot_mapping=np.zeros(num_tokens, np.int32),
                        block_tables=np.zeros((num_rows, num_pages), np.int32),
                        kv_lens=np.zeros(num_rows, np.int32),
                        cu_q_lens=np.zeros(num_rows + 1, np.int32),
                        num_seqs=np.int32(0),
                    ),
                    logits_indices=np.zeros(num_rows, np.int32),
                    sampling=sampling_metadata_from_params([], steps=[], seeds=[], num_rows=num_rows),
                )
                token_ids, logits, self.kv_cache = self._step(self.params, self.kv_cache, step)
            jax.block_until_ready(top_logprobs(logits, token_ids))
        self.copy_pages([(0, 0)])
